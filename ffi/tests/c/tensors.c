/*
 * kvwire C ABI test: an engine registers its own tensors (kvw_register_tensors)
 * and a transfer moves them between two engine layouts through two running
 * kvwired daemons; bad tensor lists are refused by name.
 *
 * Usage: tensors SOCKET_A SOCKET_B PEER_B (as transfer.c).
 *
 * Source: vLLM FlashAttention NHD, one memfd per layer holding
 * (2, blocks, block, heads, dim). Destination: FlashInfer, every layer in
 * one memfd at its own offset, (blocks, 2, block, heads, dim). Both tp=1,
 * bf16, shuffled tables, a partial final block. Offsets below come from
 * those shapes.
 */
#define _GNU_SOURCE
#include "kvwire.h"
#include "check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define LAYERS 4u
#define HEADS 4u
#define DIM 16u
#define ROW (DIM * 2u)
#define TOKENS 100u
#define CANARY 0xA5
#define SRC_BLOCK 16u
#define SRC_BLOCKS 8u
#define DST_BLOCK 32u
#define DST_BLOCKS 5u
#define GAP 4096u

static const uint32_t SRC_TABLE[] = {6, 1, 4, 0, 7, 2, 5};
static const uint32_t DST_TABLE[] = {3, 0, 4, 1};


/* Engine memory: a sealable memfd, mapped. */
typedef struct {
  int fd;
  uint8_t *p;
  size_t len;
} shm;

static shm shm_new(size_t len) {
  shm m = {memfd_create("engine", MFD_CLOEXEC | MFD_ALLOW_SEALING), NULL, len};
  REQUIRE(m.fd >= 0 && ftruncate(m.fd, (off_t)len) == 0, "memfd of %zu bytes", len);
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
  REQUIRE(p != MAP_FAILED, "mmap");
  m.p = p;
  memset(m.p, CANARY, len);
  return m;
}

static void shm_free(shm *m) {
  munmap(m->p, m->len);
  close(m->fd);
}

static uint8_t code(uint32_t layer, uint32_t kv, uint32_t head, uint64_t pos, uint32_t byte) {
  uint8_t c = (uint8_t)(layer * 131u + kv * 71u + (uint32_t)pos * 29u + head * 7u + byte * 3u);
  return c == CANARY ? (uint8_t)~CANARY : c;
}

#define SRC_TENSOR ((size_t)2 * SRC_BLOCKS * SRC_BLOCK * HEADS * ROW)
#define DST_TENSOR ((size_t)DST_BLOCKS * 2 * DST_BLOCK * HEADS * ROW)

/* vllm_nhd: (2, blocks, block, heads, dim), in layer `layer`'s own memfd. */
static size_t src_offset(uint32_t kv, uint32_t head, uint64_t pos) {
  size_t b = SRC_TABLE[pos / SRC_BLOCK], t = pos % SRC_BLOCK;
  return ((((size_t)kv * SRC_BLOCKS + b) * SRC_BLOCK + t) * HEADS + head) * ROW;
}

/* flashinfer: (blocks, 2, block, heads, dim), layer `layer` at GAP + layer * (tensor + GAP). */
static size_t dst_offset(uint32_t layer, uint32_t kv, uint32_t head, uint64_t pos) {
  size_t b = DST_TABLE[pos / DST_BLOCK], t = pos % DST_BLOCK;
  return GAP + layer * (DST_TENSOR + GAP) + (((b * 2 + kv) * DST_BLOCK + t) * HEADS + head) * ROW;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s SOCKET_A SOCKET_B PEER_B\n", argv[0]);
    return 2;
  }
  kvw_client *a = NULL;
  kvw_client *b = NULL;
  REQUIRE(kvw_client_connect(argv[1], "c-engine-prefill", &a) == KVW_OK, "connect A");
  REQUIRE(kvw_client_connect(argv[2], "c-engine-decode", &b) == KVW_OK, "connect B");

  shm src[LAYERS];
  int src_fds[LAYERS];
  for (uint32_t l = 0; l < LAYERS; l++) {
    src[l] = shm_new(SRC_TENSOR);
    src_fds[l] = src[l].fd;
  }
  shm dst = shm_new(GAP + LAYERS * (DST_TENSOR + GAP));
  uint8_t *want = malloc(dst.len);
  REQUIRE(want != NULL, "malloc");
  memset(want, CANARY, dst.len);
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t kv = 0; kv < 2; kv++)
      for (uint32_t h = 0; h < HEADS; h++)
        for (uint64_t pos = 0; pos < TOKENS; pos++)
          for (uint32_t i = 0; i < ROW; i++) {
            src[l].p[src_offset(kv, h, pos) + i] = code(l, kv, h, pos, i);
            want[dst_offset(l, kv, h, pos) + i] = code(l, kv, h, pos, i);
          }

  char src_json[2048], dst_json[2048];
  size_t at = 0, dt = 0;
  at += (size_t)snprintf(src_json + at, sizeof src_json - at, "[");
  dt += (size_t)snprintf(dst_json + dt, sizeof dst_json - dt, "[");
  for (uint32_t l = 0; l < LAYERS; l++) {
    at += (size_t)snprintf(src_json + at, sizeof src_json - at,
                           "%s{\"memory\":%u,\"offset\":0,\"dtype\":\"bf16\",\"shape\":[2,%u,%u,%u,%u],"
                           "\"strides\":[%u,%u,%u,%u,1],\"role\":\"kv\",\"layers\":[%u,%u]}",
                           l ? "," : "", l, SRC_BLOCKS, SRC_BLOCK, HEADS, DIM, SRC_BLOCKS * SRC_BLOCK * HEADS * DIM,
                           SRC_BLOCK * HEADS * DIM, HEADS * DIM, DIM, l, l + 1);
    dt += (size_t)snprintf(dst_json + dt, sizeof dst_json - dt,
                           "%s{\"memory\":0,\"offset\":%zu,\"dtype\":\"bf16\",\"shape\":[%u,2,%u,%u,%u],"
                           "\"strides\":[%u,%u,%u,%u,1],\"role\":\"kv\",\"layers\":[%u,%u]}",
                           l ? "," : "", GAP + l * (DST_TENSOR + GAP), DST_BLOCKS, DST_BLOCK, HEADS, DIM,
                           2 * DST_BLOCK * HEADS * DIM, DST_BLOCK * HEADS * DIM, HEADS * DIM, DIM, l, l + 1);
  }
  snprintf(src_json + at, sizeof src_json - at, "]");
  snprintf(dst_json + dt, sizeof dst_json - dt, "]");

  uint32_t regions = 99;
  uint64_t bytes = 99;
  bool complete = false;
  kvw_result r;
  /* Errors first: out-parameters untouched. */
  r = kvw_register_tensors(a, "c-eng-src", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY, src_json,
                           NULL, 2, &regions, &bytes, &complete);
  CHECK(r == KVW_NULL_ARGUMENT, "NULL fds with n_fds 2: %u", r);
  r = kvw_register_tensors(a, "c-eng-src", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY, "[{]",
                           src_fds, LAYERS, &regions, &bytes, &complete);
  CHECK(r == KVW_INVALID_JSON, "bad tensors_json: %u", r);
  r = kvw_register_tensors(a, "c-eng-src", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY, src_json,
                           src_fds, 1, &regions, &bytes, &complete);
  CHECK(r == KVW_BAD_REGION && strstr(client_error(a), "memory 1 but the registration carries 1") != NULL,
        "a tensor naming a missing memfd: %u %s", r, client_error(a));
  CHECK(regions == 99 && bytes == 99 && !complete, "out-parameters untouched on failure");

  r = kvw_register_tensors(a, "c-eng-src", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY, src_json,
                           src_fds, LAYERS, &regions, &bytes, &complete);
  REQUIRE(r == KVW_OK, "register source tensors: %u %s", r, client_error(a));
  /* One region per layer: K and V share each tensor. */
  CHECK(regions == LAYERS && bytes == (uint64_t)LAYERS * SRC_TENSOR && complete, "source: %u %llu", regions,
        (unsigned long long)bytes);
  r = kvw_register_tensors(b, "c-eng-dst", MODEL, "bf16", "tp=1,block=32,kv=flashinfer", 0, DST_BLOCKS, IDENTITY, dst_json,
                           &dst.fd, 1, &regions, &bytes, &complete);
  REQUIRE(r == KVW_OK, "register destination tensors: %u %s", r, client_error(b));

  /* The same tensors as device allocations, one each: daemon a has no
   * device backend and says so; daemon b serves the stand-in one (its
   * memfds play the allocations). */
  char mem_json[512];
  at = (size_t)snprintf(mem_json, sizeof mem_json, "[");
  for (uint32_t l = 0; l < LAYERS; l++)
    at += (size_t)snprintf(mem_json + at, sizeof mem_json - at, "%s{\"ordinal\":0,\"len\":%zu,\"ipc\":null}", l ? "," : "",
                           (size_t)SRC_TENSOR);
  snprintf(mem_json + at, sizeof mem_json - at, "]");
  r = kvw_register_device_tensors(b, "c-eng-dev", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY,
                                  src_json, NULL, src_fds, LAYERS, &regions, &bytes, &complete);
  CHECK(r == KVW_NULL_ARGUMENT, "NULL memories_json: %u", r);
  r = kvw_register_device_tensors(b, "c-eng-dev", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY,
                                  src_json, "[{\"len\":1}]", src_fds, LAYERS, &regions, &bytes, &complete);
  CHECK(r == KVW_INVALID_JSON, "memories_json without an ordinal: %u", r);
  r = kvw_register_device_tensors(a, "c-eng-dev", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY,
                                  src_json, mem_json, src_fds, LAYERS, &regions, &bytes, &complete);
  CHECK(r == KVW_BAD_REGION && strstr(client_error(a), "[device] backend") != NULL, "no device backend: %u %s", r,
        client_error(a));
  r = kvw_register_device_tensors(b, "c-eng-dev", MODEL, "bf16", "tp=1,block=16,kv=vllm_nhd", 0, SRC_BLOCKS, IDENTITY,
                                  src_json, mem_json, src_fds, LAYERS, &regions, &bytes, &complete);
  CHECK(r == KVW_OK && regions == LAYERS && bytes == (uint64_t)LAYERS * SRC_TENSOR && complete,
        "device tensors on the stand-in backend: %u %s", r, client_error(b));
  CHECK(kvw_release_cache(b, "c-eng-dev", 0) == KVW_OK, "release the device tensors");

  uint16_t slot = 0, sslot = 0, peer_slot = 0;
  uint64_t ns = 0;
  REQUIRE(kvw_prepare_receive(b, "c-eng-dst", "ce1", DST_TABLE, 4, TOKENS, 0, &slot) == KVW_OK, "prepare: %s",
          client_error(b));
  REQUIRE(kvw_submit(a, "pce1", "c-eng-src", SRC_TABLE, 7, TOKENS, argv[3], "c-eng-dst", "ce1", &sslot, &peer_slot) == KVW_OK,
          "submit: %s", client_error(a));
  REQUIRE(kvw_wait(b, slot, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns) == KVW_OK, "decoder_usable: %s", client_error(b));
  REQUIRE(kvw_wait(a, sslot, KVW_FLAG_SOURCE_RELEASED, 0, 20000, &ns) == KVW_OK, "source_released: %s", client_error(a));
  size_t first = dst.len;
  for (size_t i = 0; i < dst.len && first == dst.len; i++) {
    if (dst.p[i] != want[i]) first = i;
  }
  CHECK(first == dst.len, "destination byte %zu: %#x, expected %#x", first, first < dst.len ? dst.p[first] : 0,
        first < dst.len ? want[first] : 0);

  CHECK(kvw_release_cache(a, "c-eng-src", 0) == KVW_OK, "release source");
  CHECK(kvw_release_cache(b, "c-eng-dst", 0) == KVW_OK, "release destination");
  kvw_client_free(a);
  kvw_client_free(b);
  for (uint32_t l = 0; l < LAYERS; l++) shm_free(&src[l]);
  shm_free(&dst);
  free(want);
  printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
