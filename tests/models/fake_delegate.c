/*
 * Fake TFLite external delegate for tests: every delegate failure path without hardware.
 *
 * Implements the plugin ABI that `load_delegate(path, options)` (ai_edge_litert and
 * tflite_runtime) calls, as declared in
 * tensorflow/lite/delegates/external/external_delegate_interface.h:
 *
 *   TfLiteDelegate* tflite_plugin_create_delegate(char** keys, char** values, size_t n,
 *                                                 void (*report_error)(const char*));
 *   void tflite_plugin_destroy_delegate(TfLiteDelegate* delegate);
 *
 * Option "mode" (default "noop"):
 *   noop              Prepare returns kTfLiteOk and claims no nodes: the model silently runs on
 *                     the CPU kernels.
 *   fail_prepare      Prepare returns kTfLiteError: Interpreter construction raises RuntimeError.
 *   refuse            create reports "refused" and returns NULL: load_delegate raises ValueError.
 *   abort_on_create   create calls abort(): the process dies with SIGABRT.
 *   abort_on_prepare  Prepare calls abort(): the process dies with SIGABRT.
 * Any other mode is refused like "refuse", with the message "fake delegate: unknown mode".
 *
 * Build: gcc -shared -fPIC -O2 -o libfake_delegate.so fake_delegate.c
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Mirrors tensorflow/lite/core/c/common.h; runtime-owned types are opaque (void*) here. */
typedef enum { kTfLiteOk = 0, kTfLiteError = 1 } TfLiteStatus;
typedef int TfLiteBufferHandle;

typedef struct TfLiteDelegate {
  void* data_;
  TfLiteStatus (*Prepare)(void* context, struct TfLiteDelegate* delegate);
  TfLiteStatus (*CopyFromBufferHandle)(void* context, struct TfLiteDelegate* delegate,
                                       TfLiteBufferHandle buffer_handle, void* tensor);
  TfLiteStatus (*CopyToBufferHandle)(void* context, struct TfLiteDelegate* delegate,
                                     TfLiteBufferHandle buffer_handle, void* tensor);
  void (*FreeBufferHandle)(void* context, struct TfLiteDelegate* delegate,
                           TfLiteBufferHandle* handle);
  int64_t flags;                  /* kTfLiteDelegateFlagsNone */
  void* opaque_delegate_builder;  /* NULL: the runtime calls Prepare above */
} TfLiteDelegate;

typedef enum { MODE_NOOP, MODE_FAIL_PREPARE, MODE_ABORT_ON_PREPARE } PrepareMode;

typedef struct {
  PrepareMode mode;
} FakeDelegateData;

static TfLiteStatus fake_prepare(void* context, TfLiteDelegate* delegate) {
  (void)context;
  switch (((FakeDelegateData*)delegate->data_)->mode) {
    case MODE_FAIL_PREPARE:
      return kTfLiteError;
    case MODE_ABORT_ON_PREPARE:
      abort();
    default:
      return kTfLiteOk; /* claims nothing: never calls ReplaceNodeSubsetsWithDelegateKernels */
  }
}

static TfLiteStatus fake_copy(void* context, TfLiteDelegate* delegate,
                              TfLiteBufferHandle buffer_handle, void* tensor) {
  (void)context;
  (void)delegate;
  (void)buffer_handle;
  (void)tensor;
  return kTfLiteError; /* never called: no node is delegated, no buffer handle exists */
}

static void fake_free(void* context, TfLiteDelegate* delegate, TfLiteBufferHandle* handle) {
  (void)context;
  (void)delegate;
  (void)handle;
}

static const char* find_option(char** keys, char** values, size_t n, const char* key) {
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] != NULL && strcmp(keys[i], key) == 0) return values[i];
  }
  return NULL;
}

/* Create-time outcome of a mode name: 0 = build a delegate with *mode, 1 = refuse,
 * -1 = unknown mode. "abort_on_create" never returns. */
static int parse_mode(const char* name, PrepareMode* mode) {
  if (name == NULL || strcmp(name, "noop") == 0) {
    *mode = MODE_NOOP;
  } else if (strcmp(name, "fail_prepare") == 0) {
    *mode = MODE_FAIL_PREPARE;
  } else if (strcmp(name, "abort_on_prepare") == 0) {
    *mode = MODE_ABORT_ON_PREPARE;
  } else if (strcmp(name, "abort_on_create") == 0) {
    abort();
  } else if (strcmp(name, "refuse") == 0) {
    return 1;
  } else {
    return -1;
  }
  return 0;
}

static void report(void (*report_error)(const char*), const char* message) {
  if (report_error != NULL) report_error(message);
}

TfLiteDelegate* tflite_plugin_create_delegate(char** keys, char** values, size_t n,
                                              void (*report_error)(const char*)) {
  /* ctypes declares n as c_int; libffi widens it, but keep only the int's bits to be safe. */
  const char* name = find_option(keys, values, (size_t)(unsigned int)n, "mode");
  PrepareMode mode = MODE_NOOP;
  int parsed = parse_mode(name, &mode);
  if (parsed != 0) {
    report(report_error, parsed > 0 ? "refused" : "fake delegate: unknown mode");
    return NULL;
  }
  TfLiteDelegate* delegate = calloc(1, sizeof(TfLiteDelegate));
  FakeDelegateData* data = calloc(1, sizeof(FakeDelegateData));
  if (delegate == NULL || data == NULL) {
    free(delegate);
    free(data);
    report(report_error, "fake delegate: out of memory");
    return NULL;
  }
  data->mode = mode;
  delegate->data_ = data;
  delegate->Prepare = fake_prepare;
  delegate->CopyFromBufferHandle = fake_copy;
  delegate->CopyToBufferHandle = fake_copy;
  delegate->FreeBufferHandle = fake_free;
  return delegate;
}

void tflite_plugin_destroy_delegate(TfLiteDelegate* delegate) {
  if (delegate == NULL) return;
  free(delegate->data_);
  free(delegate);
}
