//! The in-run baselines: `memcpy` and a plain TCP socket pair, with the
//! point's concurrency.

use super::lockstep::lockstep;
use anyhow::anyhow;
use kvwire_transport::HostMem;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Per-stream GB/s of a lock-step baseline: bytes over summed stream time.
fn per_stream_gbps(size: u64, samples: &[Vec<Duration>]) -> f64 {
    let timed: Vec<Duration> = samples.iter().flat_map(|l| l.iter().skip(1)).copied().collect();
    let ns: u128 = timed.iter().map(|d| d.as_nanos().max(1)).sum();
    if ns == 0 {
        0.0
    } else {
        (size as f64 * timed.len() as f64) / ns as f64
    }
}

/// `c` threads at once, each copying `size` bytes between two mappings of
/// its own; one warm-up round, then `iters`.
pub(super) fn memcpy_baseline(size: u64, c: u32, iters: u32) -> anyhow::Result<f64> {
    let pattern = vec![0x5Au8; size as usize];
    let mut states = Vec::with_capacity(c as usize);
    for _ in 0..c {
        let a = HostMem::new("kvwire-campaign-memcpy-a", size)?;
        a.write(0, &pattern)?;
        states.push((a, HostMem::new("kvwire-campaign-memcpy-b", size)?));
    }
    drop(pattern);
    let samples = lockstep(states, iters as usize + 1, |_, (a, b)| {
        let start = Instant::now();
        a.copy_to(0, b, 0, size)?;
        Ok(start.elapsed())
    })?;
    Ok(per_stream_gbps(size, &samples))
}

/// `c` plain TCP socket pairs on loopback at once, each streaming `size`
/// bytes to a receiver that reads every byte into a buffer and answers one
/// byte; timed until that answer. One warm-up round, then `iters`.
pub(super) fn socket_baseline(size: u64, c: u32, iters: u32) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut senders = Vec::with_capacity(c as usize);
    let mut receivers = Vec::with_capacity(c as usize);
    for _ in 0..c {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let (r, _) = listener.accept()?;
        r.set_nodelay(true)?;
        let rounds = iters + 1;
        receivers.push(std::thread::spawn(move || -> std::io::Result<()> {
            let mut r = r;
            let mut buf = vec![0u8; size as usize];
            for _ in 0..rounds {
                r.read_exact(&mut buf)?;
                r.write_all(&[1])?;
            }
            Ok(())
        }));
        senders.push(s);
    }
    let data = vec![0x5Au8; size as usize];
    let samples = lockstep(senders, iters as usize + 1, |_, s| {
        let mut ack = [0u8; 1];
        let start = Instant::now();
        s.write_all(&data)?;
        s.read_exact(&mut ack)?;
        Ok(start.elapsed())
    });
    // On failure the senders are dropped by now, so every receiver ends.
    for r in receivers {
        r.join().map_err(|_| anyhow!("baseline receiver panicked"))??;
    }
    Ok(per_stream_gbps(size, &samples?))
}
