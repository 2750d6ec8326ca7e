/*
 * kvwire C ABI test: a transfer between two running kvwired daemons, and
 * the error paths of the API.
 *
 * Usage: transfer SOCKET_A SOCKET_B PEER_B
 *   SOCKET_A  control socket of the source daemon (configured with peer B)
 *   SOCKET_B  control socket of the destination daemon
 *   PEER_B    B's node name, as A's config names it
 *
 * scripts/ffi-check starts the daemons, builds this with
 * -Wall -Wextra -Werror -fsanitize=address,undefined and runs it.
 *
 * The source rank (tp=1, block 16, nhd) and the destination rank (tp=1,
 * block 32, hnd) use different block sizes, row orders and shuffled block
 * tables, so the check recomputes every destination row's offset from the
 * layout definition: block_table[pos / B] * block_bytes + row * row_bytes,
 * row = slot * heads + head (nhd) or head * B + slot (hnd).
 */
#include "kvwire.h"
#include "check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The toy model: 4 dense layers, 4 KV heads of 16 dims, bf16. */
#define LAYERS 4u
#define HEADS 4u
#define DIM 16u
#define ROW (DIM * 2u) /* bytes of one head's row (bf16) */
#define TENSORS 2u     /* K, V */
#define TOKENS 100u    /* a partial final block on both sides */
#define CANARY 0xA5

#define SRC_BLOCK 16u
#define SRC_BLOCKS 10u
#define DST_BLOCK 32u
#define DST_BLOCKS 6u

static const char *SRC_LAYOUT = "tp=1,block=16,layout=nhd";
static const char *DST_LAYOUT = "tp=1,block=32,layout=hnd";

/* Block tables: shuffled, 7 and 4 blocks for 100 tokens. */
static const uint32_t SRC_TABLE[] = {3, 7, 0, 9, 5, 1, 8};
static const uint32_t DST_TABLE[] = {4, 1, 5, 2};


static const char *strerror_text(uint32_t code) {
  static char buf[KVW_MESSAGE_MAX];
  size_t n = 0;
  if (kvw_strerror(code, buf, sizeof buf, &n) != KVW_OK) {
    return "(kvw_strerror failed)";
  }
  return buf;
}

/* The value of one source byte: a hash of what identifies it, never CANARY. */
static uint8_t code(uint32_t layer, uint32_t tensor, uint32_t head, uint64_t pos, uint32_t byte) {
  uint64_t z = ((uint64_t)layer << 48) ^ ((uint64_t)tensor << 44) ^ ((uint64_t)head << 32) ^ (pos << 16) ^ byte;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  uint8_t c = (uint8_t)(z ^ (z >> 31));
  return c == CANARY ? (uint8_t)~CANARY : c;
}

static size_t src_offset(uint32_t layer, uint32_t tensor, uint32_t head, uint64_t pos) {
  size_t block_bytes = (size_t)SRC_BLOCK * HEADS * ROW;
  size_t region = (size_t)(layer * TENSORS + tensor) * SRC_BLOCKS * block_bytes;
  size_t row = (size_t)(pos % SRC_BLOCK) * HEADS + head; /* nhd */
  return region + (size_t)SRC_TABLE[pos / SRC_BLOCK] * block_bytes + row * ROW;
}

static size_t dst_offset(uint32_t layer, uint32_t tensor, uint32_t head, uint64_t pos) {
  size_t block_bytes = (size_t)DST_BLOCK * HEADS * ROW;
  size_t region = (size_t)(layer * TENSORS + tensor) * DST_BLOCKS * block_bytes;
  size_t row = (size_t)head * DST_BLOCK + (pos % DST_BLOCK); /* hnd */
  return region + (size_t)DST_TABLE[pos / DST_BLOCK] * block_bytes + row * ROW;
}

/* Error paths that need no daemon. */
static void test_local_errors(void) {
  char buf[KVW_MESSAGE_MAX];
  char small[4] = {'x', 'x', 'x', 'x'};
  size_t n = 12345;

  CHECK(strcmp(strerror_text(KVW_OK), "success") == 0, "%s", strerror_text(KVW_OK));
  CHECK(strcmp(strerror_text(KVW_BAD_LAYOUT), "bad layout or cache format") == 0, "%s",
        strerror_text(KVW_BAD_LAYOUT));
  CHECK(strcmp(strerror_text(KVW_NULL_ARGUMENT), "a required pointer argument was NULL") == 0, "%s",
        strerror_text(KVW_NULL_ARGUMENT));
  CHECK(strcmp(strerror_text(999999), "unknown kvwire result code") == 0, "%s", strerror_text(999999));
  CHECK(KVW_BAD_LAYOUT == 102 && KVW_AUTH_FAILED == 202 && KVW_TIMEOUT == 301 && KVW_PERMISSION_DENIED == 400,
        "result codes match the daemon's numbers");

  /* A buffer too small: nothing written, out_len untouched. */
  CHECK(kvw_strerror(KVW_BAD_LAYOUT, small, sizeof small, &n) == KVW_BUFFER_TOO_SMALL, "small buffer");
  CHECK(small[0] == 'x' && small[3] == 'x' && n == 12345, "nothing written on failure");
  CHECK(kvw_strerror(KVW_OK, NULL, 10, &n) == KVW_NULL_ARGUMENT, "NULL buf");
  CHECK(kvw_strerror(KVW_OK, buf, sizeof buf, NULL) == KVW_NULL_ARGUMENT, "NULL out_len");

  /* NULL handles and out-parameters. */
  kvw_client *c = (kvw_client *)0x1;
  CHECK(kvw_client_connect(NULL, "x", &c) == KVW_NULL_ARGUMENT, "NULL socket_path");
  CHECK(c == (kvw_client *)0x1, "out untouched on failure");
  CHECK(kvw_client_connect("/nonexistent", NULL, &c) == KVW_NULL_ARGUMENT, "NULL client_name");
  CHECK(kvw_client_connect("/nonexistent", "x", NULL) == KVW_NULL_ARGUMENT, "NULL out");
  CHECK(kvw_last_error(buf, sizeof buf, &n) == KVW_OK && strstr(buf, "`out`") != NULL, "last error: %s", buf);
  CHECK(kvw_client_connect("/nonexistent/kvwired.sock", "x", &c) == KVW_IO, "no daemon there");
  CHECK(c == (kvw_client *)0x1, "out untouched on failure");
  CHECK(kvw_last_error(buf, sizeof buf, &n) == KVW_OK && strstr(buf, "connect") != NULL, "last error: %s", buf);
  const char bad_utf8[] = {(char)0xff, (char)0xfe, 0};
  CHECK(kvw_client_connect(bad_utf8, "x", &c) == KVW_INVALID_UTF8, "invalid UTF-8 path");

  uint16_t slot = 7;
  uint64_t ns = 0;
  bool ready = true;
  CHECK(kvw_prepare_receive(NULL, "g", "r", DST_TABLE, 4, TOKENS, 0, &slot) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_wait(NULL, 0, KVW_FLAG_DECODER_USABLE, 0, 1, &ns) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_client_set_wait_spin(NULL, 0) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_is_ready(NULL, 0, KVW_FLAG_DECODER_USABLE, 0, &ready) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_cancel(NULL, 0) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_release_cache(NULL, "g", 0) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_share_group(NULL, "g", "0123456789abcdef") == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(kvw_client_last_error(NULL, buf, sizeof buf, &n) == KVW_NULL_ARGUMENT, "NULL client");
  CHECK(slot == 7 && ready, "out-parameters untouched on failure");

  kvw_mem *m = NULL;
  CHECK(kvw_mem_new(0, &m) == KVW_INVALID_ARGUMENT && m == NULL, "zero-length memory");
  CHECK(kvw_mem_new(64, NULL) == KVW_NULL_ARGUMENT, "NULL out");
  CHECK(kvw_mem_ptr(NULL) == NULL && kvw_mem_len(NULL) == 0, "NULL mem accessors");
  kvw_mem_free(NULL);
  kvw_client_free(NULL);

  uint32_t regions = 0;
  uint64_t bytes = 0;
  CHECK(kvw_cache_size(MODEL, "bf16", "tp=3", 0, 4, &regions, &bytes) == KVW_BAD_LAYOUT, "tp=3 of 4 heads");
  CHECK(kvw_cache_size("{\"toml\":", "bf16", "tp=1", 0, 4, &regions, &bytes) == KVW_INVALID_JSON, "bad JSON");
  CHECK(regions == 0 && bytes == 0, "out-parameters untouched on failure");
}

static void test_transfer(const char *sock_a, const char *sock_b, const char *peer_b) {
  char buf[KVW_MESSAGE_MAX];
  size_t n = 0;
  kvw_client *a = NULL;
  kvw_client *b = NULL;
  kvw_result r;

  r = kvw_client_connect(sock_a, "c-prefill", &a);
  REQUIRE(r == KVW_OK, "connect A: %u %s", r, (kvw_last_error(buf, sizeof buf, &n), buf));
  r = kvw_client_connect(sock_b, "c-decode", &b);
  REQUIRE(r == KVW_OK, "connect B: %u %s", r, (kvw_last_error(buf, sizeof buf, &n), buf));
  CHECK(kvw_client_node(b, buf, sizeof buf, &n) == KVW_OK && strcmp(buf, peer_b) == 0 && n == strlen(peer_b),
        "B's node: %s", buf);

  /* Sizes: computed locally, and by hand. */
  uint32_t src_regions = 0, dst_regions = 0;
  uint64_t src_bytes = 0, dst_bytes = 0;
  REQUIRE(kvw_cache_size(MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, &src_regions, &src_bytes) == KVW_OK, "size");
  REQUIRE(kvw_cache_size(MODEL, "bf16", DST_LAYOUT, 0, DST_BLOCKS, &dst_regions, &dst_bytes) == KVW_OK, "size");
  REQUIRE(src_regions == LAYERS * TENSORS && src_bytes == (uint64_t)LAYERS * TENSORS * SRC_BLOCKS * SRC_BLOCK * HEADS * ROW,
          "source size %u %llu", src_regions, (unsigned long long)src_bytes);
  REQUIRE(dst_regions == LAYERS * TENSORS && dst_bytes == (uint64_t)LAYERS * TENSORS * DST_BLOCKS * DST_BLOCK * HEADS * ROW,
          "destination size %u %llu", dst_regions, (unsigned long long)dst_bytes);

  kvw_mem *src = NULL;
  kvw_mem *dst = NULL;
  REQUIRE(kvw_mem_new((size_t)src_bytes, &src) == KVW_OK && kvw_mem_len(src) == src_bytes, "source memory");
  REQUIRE(kvw_mem_new((size_t)dst_bytes, &dst) == KVW_OK && kvw_mem_len(dst) == dst_bytes, "destination memory");
  uint8_t *s = kvw_mem_ptr(src);
  uint8_t *d = kvw_mem_ptr(dst);
  REQUIRE(s != NULL && d != NULL, "pointers");

  /* Source: every written row carries its code; the expected destination
   * is canary everywhere but the same rows at their new places. */
  uint8_t *want = malloc((size_t)dst_bytes);
  REQUIRE(want != NULL, "malloc");
  memset(want, CANARY, (size_t)dst_bytes);
  memset(d, CANARY, (size_t)dst_bytes);
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    for (uint32_t t = 0; t < TENSORS; t++) {
      for (uint32_t h = 0; h < HEADS; h++) {
        for (uint64_t pos = 0; pos < TOKENS; pos++) {
          size_t so = src_offset(layer, t, h, pos);
          size_t dof = dst_offset(layer, t, h, pos);
          for (uint32_t byte = 0; byte < ROW; byte++) {
            s[so + byte] = code(layer, t, h, pos, byte);
            want[dof + byte] = code(layer, t, h, pos, byte);
          }
        }
      }
    }
  }

  /* A bad layout is 102, with the daemon's message; out-parameters untouched. */
  uint32_t regions = 99;
  uint64_t bytes = 99;
  bool complete = true;
  r = kvw_register_cache(a, "prefill", MODEL, "bf16", "tp=1,block=16,layout=diagonal", 0, SRC_BLOCKS, IDENTITY, src,
                         &regions, &bytes, &complete);
  CHECK(r == KVW_BAD_LAYOUT && r == 102, "bad layout: got %u", r);
  CHECK(strstr(client_error(a), "diagonal") != NULL, "message names the bad value: %s", client_error(a));
  CHECK(regions == 99 && bytes == 99 && complete, "out-parameters untouched on failure");
  r = kvw_register_cache(a, "prefill", MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, "{\"tenant\":\"t1\"}", src, &regions,
                         &bytes, &complete);
  CHECK(r == KVW_INVALID_JSON, "identity without its fields: got %u", r);
  r = kvw_register_cache(a, "prefill", MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, IDENTITY, NULL, &regions, &bytes,
                         &complete);
  CHECK(r == KVW_NULL_ARGUMENT, "NULL mem: got %u", r);

  /* Device memory on a daemon without a [device] backend: 103, naming the
   * setting; a handle length without a handle is refused locally. */
  r = kvw_register_device_cache(a, "prefill-dev", MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, IDENTITY, 0, src_bytes, -1,
                                NULL, 0, &regions, &bytes, &complete);
  CHECK(r == KVW_BAD_REGION, "device cache without a device backend: got %u", r);
  CHECK(strstr(client_error(a), "[device] backend") != NULL, "message names the setting: %s", client_error(a));
  r = kvw_register_device_cache(a, "prefill-dev", MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, IDENTITY, 0, src_bytes, -1,
                                NULL, 64, &regions, &bytes, &complete);
  CHECK(r == KVW_NULL_ARGUMENT, "NULL ipc handle with a length: got %u", r);
  CHECK(regions == 99 && bytes == 99 && complete, "out-parameters untouched on failure");

  /* Register both sides. */
  r = kvw_register_cache(a, "prefill", MODEL, "bf16", SRC_LAYOUT, 0, SRC_BLOCKS, IDENTITY, src, &regions, &bytes,
                         &complete);
  REQUIRE(r == KVW_OK, "register source: %u %s", r, client_error(a));
  CHECK(regions == src_regions && bytes == src_bytes && complete, "registered %u regions, %llu bytes", regions,
        (unsigned long long)bytes);
  r = kvw_register_cache(b, "decode", MODEL, "bf16", DST_LAYOUT, 0, DST_BLOCKS, IDENTITY, dst, &regions, &bytes,
                         &complete);
  REQUIRE(r == KVW_OK, "register destination: %u %s", r, client_error(b));
  CHECK(regions == dst_regions && bytes == dst_bytes && complete, "registered");

  /* Prepare, submit, wait for every flag. */
  uint16_t slot = 0, sslot = 0, peer_slot = 0;
  r = kvw_prepare_receive(b, "decode", "r1", DST_TABLE, sizeof DST_TABLE / sizeof DST_TABLE[0], TOKENS, 0, &slot);
  REQUIRE(r == KVW_OK, "prepare: %u %s", r, client_error(b));
  r = kvw_submit(a, "p1", "prefill", SRC_TABLE, sizeof SRC_TABLE / sizeof SRC_TABLE[0], TOKENS, peer_b, "decode", "r1",
                 &sslot, &peer_slot);
  REQUIRE(r == KVW_OK, "submit: %u %s", r, client_error(a));
  CHECK(peer_slot == slot, "peer slot %u, prepared slot %u", peer_slot, slot);
  uint64_t ns = 0;
  /* The destination's waits sleep at once; the source's poll first (the default). */
  REQUIRE(kvw_client_set_wait_spin(b, 0) == KVW_OK, "set_wait_spin: %s", client_error(b));
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    r = kvw_wait(b, slot, KVW_FLAG_LAYER_READY, layer, 20000, &ns);
    CHECK(r == KVW_OK, "layer_ready(%u): %u %s", layer, r, client_error(b));
  }
  r = kvw_wait(b, slot, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns);
  CHECK(r == KVW_OK, "decoder_usable: %u %s", r, client_error(b));
  r = kvw_wait(a, sslot, KVW_FLAG_SOURCE_RELEASED, 0, 20000, &ns);
  CHECK(r == KVW_OK, "source_released: %u %s", r, client_error(a));
  /* The source is done once the destination's verdict came back: its own decoder_usable. */
  r = kvw_wait(a, sslot, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns);
  CHECK(r == KVW_OK, "source decoder_usable (the destination's verdict): %u %s", r, client_error(a));
  bool ready = false;
  CHECK(kvw_is_ready(b, slot, KVW_FLAG_DECODER_USABLE, 0, &ready) == KVW_OK && ready, "decoder_usable is set");
  CHECK(kvw_is_ready(b, slot, KVW_FLAG_LAYER_READY, LAYERS - 1, &ready) == KVW_OK && ready, "last layer is set");
  kvw_state state = 99;
  CHECK(kvw_status(b, slot, &state) == KVW_OK && state == KVW_STATE_DONE, "destination state %u", state);
  CHECK(kvw_status(a, sslot, &state) == KVW_OK && state == KVW_STATE_DONE, "source state %u", state);
  /* The full status as JSON: the destination's marks end with decoder_usable; a short buffer is refused untouched. */
  char js[8192];
  size_t js_len = 0;
  r = kvw_status_json(b, slot, js, sizeof js, &js_len);
  CHECK(r == KVW_OK && js_len == strlen(js), "status_json: %u %s", r, client_error(b));
  CHECK(strstr(js, "\"state\":\"done\"") != NULL && strstr(js, "\"name\":\"decoder_usable\"") != NULL, "status json: %s", js);
  char small[8] = "canary";
  size_t small_len = 99;
  CHECK(kvw_status_json(b, slot, small, sizeof small, &small_len) == KVW_BUFFER_TOO_SMALL && small_len == 99 && strcmp(small, "canary") == 0,
        "a short buffer");
  CHECK(kvw_status_json(b, 250, js, sizeof js, &js_len) == KVW_UNKNOWN_SLOT, "status_json of an unknown slot");

  /* Every destination byte: moved rows in their new places, canary elsewhere. */
  size_t bad = 0, first_bad = 0;
  for (size_t i = 0; i < (size_t)dst_bytes; i++) {
    if (d[i] != want[i]) {
      if (bad == 0) {
        first_bad = i;
      }
      bad++;
    }
  }
  CHECK(bad == 0, "%zu destination bytes differ, first at %zu (got %02x want %02x)", bad, first_bad, d[first_bad],
        want[first_bad]);

  /* Prepared naming its source: A's peer connection is idle at B now, so
   * B announces the receive to A, whose submit claims it with no round
   * trip; the bytes are the same. */
  char node_a[KVW_MESSAGE_MAX];
  REQUIRE(kvw_client_node(a, node_a, sizeof node_a, &n) == KVW_OK, "A's node");
  memset(d, CANARY, (size_t)dst_bytes);
  int announced = -1;
  r = kvw_prepare_receive_from(b, "decode", "r1b", DST_TABLE, sizeof DST_TABLE / sizeof DST_TABLE[0], TOKENS, 0, node_a,
                               &slot, &announced);
  REQUIRE(r == KVW_OK, "prepare naming the source: %u %s", r, client_error(b));
  CHECK(announced == 1, "announced to %s: %d", node_a, announced);
  r = kvw_submit(a, "p1b", "prefill", SRC_TABLE, sizeof SRC_TABLE / sizeof SRC_TABLE[0], TOKENS, peer_b, "decode", "r1b",
                 &sslot, &peer_slot);
  REQUIRE(r == KVW_OK, "submit into the announced receive: %u %s", r, client_error(a));
  CHECK(peer_slot == slot, "peer slot %u, prepared slot %u", peer_slot, slot);
  r = kvw_wait(b, slot, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns);
  CHECK(r == KVW_OK, "decoder_usable (announced): %u %s", r, client_error(b));
  r = kvw_wait(a, sslot, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns);
  CHECK(r == KVW_OK, "source decoder_usable (announced): %u %s", r, client_error(a));
  CHECK(memcmp(d, want, (size_t)dst_bytes) == 0, "destination bytes of the announced transfer differ");
  uint16_t slot3 = 0;
  CHECK(kvw_prepare_receive_from(b, "decode", "r1c", DST_TABLE, 4, TOKENS, 0, node_a, &slot3, NULL) == KVW_OK,
        "out_announced may be NULL: %s", client_error(b));
  CHECK(kvw_cancel(b, slot3) == KVW_OK, "cancel the announced receive: %s", client_error(b));
  CHECK(kvw_prepare_receive_from(b, "decode", "r1d", DST_TABLE, 4, TOKENS, 0, node_a, NULL, &announced) == KVW_NULL_ARGUMENT,
        "NULL out_slot");

  /* A flag that does not come: timeout, then cancel → cancelled. */
  uint16_t slot2 = 0;
  r = kvw_prepare_receive(b, "decode", "r2", DST_TABLE, 4, TOKENS, 0, &slot2);
  REQUIRE(r == KVW_OK, "prepare r2: %u %s", r, client_error(b));
  r = kvw_prepare_receive(b, "decode", "r2", DST_TABLE, 4, TOKENS, 0, &slot);
  CHECK(r == KVW_BAD_REQUEST, "the same request prepared twice: %u", r);
  ns = 777;
  CHECK(kvw_wait(b, slot2, KVW_FLAG_LAYER_READY, 0, 20, &ns) == KVW_TIMEOUT && ns == 777, "timeout");
  CHECK(strstr(client_error(b), "not ready") != NULL, "timeout message: %s", client_error(b));
  CHECK(kvw_is_ready(b, slot2, KVW_FLAG_DECODER_USABLE, 0, &ready) == KVW_OK && !ready, "not ready");
  CHECK(kvw_wait(b, slot2, 42, 0, 20, &ns) == KVW_INVALID_ARGUMENT, "unknown flag kind");
  CHECK(kvw_wait(b, slot2, KVW_FLAG_LAYER_READY, 1u << 20, 20, &ns) == KVW_INVALID_ARGUMENT, "layer out of range");
  CHECK(kvw_wait(b, 60000, KVW_FLAG_DECODER_USABLE, 0, 20, &ns) == KVW_INVALID_ARGUMENT, "slot out of range");
  CHECK(kvw_cancel(b, slot2) == KVW_OK, "cancel: %s", client_error(b));
  r = kvw_wait(b, slot2, KVW_FLAG_DECODER_USABLE, 0, 20000, &ns);
  CHECK(r == KVW_CANCELLED, "wait on a cancelled slot: %u %s", r, client_error(b));
  CHECK(kvw_cancel(b, slot2) == KVW_BAD_REQUEST, "cancel twice");
  CHECK(kvw_status(b, 250, &state) == KVW_UNKNOWN_SLOT, "unknown slot");

  /* Submitting to a request nobody prepared. */
  r = kvw_submit(a, "p9", "prefill", SRC_TABLE, 7, TOKENS, peer_b, "decode", "nobody", &sslot, &peer_slot);
  CHECK(r >= 100 && r < 400, "submit to an unprepared request: %u %s", r, client_error(a));
  /* kvwire.vllm's producer retries on exactly this refusal (the consumer prepares when vLLM allocates its blocks). */
  CHECK(r == KVW_PEER_REFUSED && strstr(client_error(a), "is not prepared") != NULL, "the refusal names it: %u %s", r,
        client_error(a));
  r = kvw_submit(a, "p9", "prefill", SRC_TABLE, 7, TOKENS, "no-such-peer", "decode", "r1", &sslot, &peer_slot);
  CHECK(r == KVW_UNKNOWN_PEER, "unknown peer: %u %s", r, client_error(a));

  CHECK(kvw_release_cache(a, "prefill", 0) == KVW_OK, "release source: %s", client_error(a));
  CHECK(kvw_release_cache(b, "decode", 0) == KVW_OK, "release destination: %s", client_error(b));
  r = kvw_release_cache(b, "decode", 0);
  CHECK(r == KVW_UNKNOWN_GROUP, "release twice: %u", r);

  free(want);
  kvw_mem_free(src);
  kvw_mem_free(dst);
  /* A group is shared only among the clients presenting its token. */
  kvw_client *other = NULL;
  CHECK(kvw_client_connect(sock_a, "c-other", &other) == KVW_OK, "third client: %s", client_error(other));
  CHECK(kvw_share_group(a, "c-shared", "0123456789abcdef") == KVW_OK, "share: %s", client_error(a));
  CHECK(kvw_share_group(other, "c-shared", "fedcba9876543210") == KVW_PERMISSION_DENIED, "another token refused");
  CHECK(kvw_share_group(other, "c-shared", "short") == KVW_BAD_REQUEST, "a short token refused");
  CHECK(kvw_share_group(other, "c-shared", NULL) == KVW_NULL_ARGUMENT, "NULL token");
  CHECK(kvw_share_group(other, "c-shared", "0123456789abcdef") == KVW_OK, "the same token joins: %s", client_error(other));
  kvw_client_free(other);

  kvw_client_free(a);
  kvw_client_free(b);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s SOCKET_A SOCKET_B PEER_B\n", argv[0]);
    return 2;
  }
  test_local_errors();
  test_transfer(argv[1], argv[2], argv[3]);
  printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
