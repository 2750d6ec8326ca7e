//! kvwire's end-to-end test support.
//!
//! [`tinylm`] is a small, real transformer (GQA attention with RoPE, SwiGLU
//! MLP, optional LoRA adapter) whose KV cache kvwire moves: the prefill side
//! computes and scatters it, the decode side gathers it and runs a decode
//! step, and the logits are compared with a local computation.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod engine;
pub mod scenario;
pub mod tinylm;
