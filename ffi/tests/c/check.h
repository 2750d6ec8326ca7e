/* What every C test of the ABI shares: its pass/fail counters, CHECK
 * (counts and reports a failed condition, then goes on) and REQUIRE (stops
 * the test: later steps depend on this one), and the client's last error.
 * Each test is its own program; include this once, after kvwire.h. */
#ifndef KVWIRE_TEST_CHECK_H
#define KVWIRE_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int failures = 0;
static int passes = 0;

#define CHECK(cond, ...)                                                    \
  do {                                                                      \
    if (cond) {                                                             \
      passes++;                                                             \
    } else {                                                                \
      failures++;                                                           \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      fprintf(stderr, __VA_ARGS__);                                         \
      fprintf(stderr, "\n");                                                \
    }                                                                       \
  } while (0)

/* Stops the test: later steps depend on this one. Evaluates `cond` once. */
#define REQUIRE(cond, ...)                                                  \
  do {                                                                      \
    int required_ = failures;                                               \
    CHECK(cond, __VA_ARGS__);                                               \
    if (failures != required_) {                                            \
      fprintf(stderr, "%d passed, %d failed\n", passes, failures);          \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

/* The toy model both tests cache (4 dense bf16 layers, 4 KV heads of 16
 * elements), and the identity its caches are registered under. */
static const char *MODEL =
    "{\"toml\":\"name = \\\"toy\\\"\\ndtype = \\\"bf16\\\"\\n[[layers]]\\nrepeat = 4\\n"
    "attention = \\\"dense\\\"\\nkv_heads = 4\\nhead_dim = 16\\n\"}";
static const char *IDENTITY =
    "{\"model_digest\":\"toy-digest\",\"adapter_digest\":\"\",\"format\":\"bf16/v1\","
    "\"tenant\":\"t1\",\"rope\":\"theta=10000\",\"position_offset\":0}";

static const char *client_error(const kvw_client *c) {
  static char buf[KVW_MESSAGE_MAX];
  size_t n = 0;
  if (kvw_client_last_error(c, buf, sizeof buf, &n) != KVW_OK) {
    return "(no message)";
  }
  return buf;
}

#endif
