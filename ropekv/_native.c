/* The replay of a launch plan in C: ropekv's hot call path without the interpreter in it.
 *
 * ropekv/_launch.py owns the call path and its semantics; this file repeats, in C, the one part of
 * it that runs on every call of a known layout (Op.__call__ -> Plan.replay -> Launch.run):
 *
 *   read each argument's layout and pointer (CuPy arrays and torch tensors of the exact base
 *   types, from the array's struct or the tensor's TensorImpl where _native.py found and checked
 *   the offsets, else through their attributes; anything else answers MISS and takes the Python
 *   path), find the plan of that layout (the newest replay's when every key equals its key,
 *   compared while reading, else the op's plan table), check written arrays against every other
 *   argument from pointers alone (any range that touches hands the call to Plan.replay, which
 *   checks exactly), pick the stream (ropekv's stream rule, through _launch's own functions), enter
 *   the plan's device, allocate outputs (Plan.make_outputs), refill each launch's parameter record
 *   on the C stack and call the driver's cuLaunchKernel / cuLaunchKernelEx (a cuBLAS step,
 *   _launch.Gemm: cublasSetStream, cublasSetPointerMode, cublasGemmEx on CuPy's handle).
 *
 * The keys it builds are the same Python objects _arrays.signature builds, so the plans a
 * first call stores serve both paths. Nothing here validates a layout: that stays on the first
 * call, in Python. ropekv/_native.py compiles this file with the system C compiler on first use
 * and falls back to the Python path when it cannot; tests/test_native.py checks, launch record by
 * launch record, that both paths launch the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>

/* ---- the driver's launch entry points, set by configure() ----------------------------------- */

typedef int (*launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                         unsigned by, unsigned bz, unsigned smem, void *stream, void **params,
                         void **extra);

typedef struct { /* CUlaunchAttribute */
  int id;
  char pad[4];
  char value[64];
} LaunchAttribute;

typedef struct { /* CUlaunchConfig */
  unsigned grid[3], block[3], smem;
  void *stream;
  LaunchAttribute *attrs;
  unsigned num_attrs;
} LaunchConfig;

typedef int (*launch_ex_fn)(const LaunchConfig *config, void *f, void **params, void **extra);

static launch_fn cu_launch = NULL;
static launch_ex_fn cu_launch_ex = NULL;

/* ---- cuBLAS, set by configure_cublas() (plans with a _launch.Gemm step) ----------------------- */

typedef int (*cublas_set_stream_fn)(void *handle, void *stream);
typedef int (*cublas_set_pointer_mode_fn)(void *handle, int mode);
typedef int (*cublas_gemm_ex_fn)(void *handle, int transa, int transb, int m, int n, int k,
                                 const void *alpha, const void *a, int a_type, int lda,
                                 const void *b, int b_type, int ldb, const void *beta, void *c,
                                 int c_type, int ldc, int compute_type, int algo);

static cublas_set_stream_fn cublas_set_stream = NULL;
static cublas_set_pointer_mode_fn cublas_set_pointer_mode = NULL;
static cublas_gemm_ex_fn cublas_gemm_ex = NULL;
static const float alpha_beta[2] = {1.0f, 0.0f}; /* CUBLAS_POINTER_MODE_HOST */
#define CUBLAS_COMPUTE_32F 68
#define CUBLAS_GEMM_DEFAULT (-1)

#define PROGRAMMATIC_STREAM_SERIALIZATION 6 /* CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIAL... */
#define RECORD_MAX 4096 /* bytes of one parameter record; a plan with a larger one stays Python */
#define MAX_ARGS 64     /* array arguments of one op, outputs included */

enum { CUPY = 1, TORCH = 2 }; /* _arrays.CUPY / TORCH */

static PyObject *s_data, *s_ptr, *s_shape, *s_strides, *s_dtype, *s_device_id, *s_data_ptr,
    *s_stride, *s_get_device, *s_last, *s_native, *s_replay, *s_make_outputs, *s_result,
    *s_getDevice, *s_setDevice, *s_empties, *one, *zero, *s_is_neg, *s_itemsize, *s_is_cuda,
    *s_size, *s_span, *s_readonly, *s_legacy, *s_device;

/* ---- a plan's launches, as C data ----------------------------------------------------------- */

typedef struct {
  int arg;     /* -1: a constant pointer field (off); else an index into the call's pointers */
  int64_t off; /* bytes added to that pointer */
} Slot;

typedef struct {
  int gemm;    /* 0: a kernel launch; 1: a cuBLAS GEMM (_launch.Gemm): slots a, b, c, then args */
  int args[8]; /* a GEMM's m, n, k, lda, ldb, ldc, A/B data type, C data type */
  void *func;
  unsigned grid[3], block[3], smem;
  int pdl;
  int n_ptr;
  Slot *slots;
  Py_ssize_t tail_len;
  char *tail; /* the record after its pointer fields (scalars), fixed for the plan */
} Step;

typedef struct {
  PyObject_HEAD
  int device;
  int n_args, n_outputs;
  int n_steps;
  Step *steps;
  int n_pairs;
  int64_t (*pairs)[6]; /* (i, j, lo_i, hi_i, lo_j, hi_j): written array i against argument j */
  int n_layered;
  int *layer_arg;
  int64_t *layer_stride;
  int64_t layer_count; /* 0: the plan serves one-layer calls only */
  int layer_strict;    /* some layer stride is not a multiple of 16: the Python path decides */
  int no_capture;      /* a call on a capturing stream goes to Plan.replay (refusal or
                          capture plan) */
} NativePlan;

static void plan_dealloc(NativePlan *self) {
  if (self->steps) {
    for (int s = 0; s < self->n_steps; s++) {
      PyMem_Free(self->steps[s].slots);
      PyMem_Free(self->steps[s].tail);
    }
    PyMem_Free(self->steps);
  }
  PyMem_Free(self->pairs);
  PyMem_Free(self->layer_arg);
  PyMem_Free(self->layer_stride);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int read_uints(PyObject *seq, unsigned out[3], const char *what) {
  PyObject *t = PySequence_Tuple(seq);
  if (!t) return -1;
  if (PyTuple_GET_SIZE(t) != 3) {
    Py_DECREF(t);
    PyErr_Format(PyExc_ValueError, "%s must have 3 entries", what);
    return -1;
  }
  for (int k = 0; k < 3; k++) {
    unsigned long v = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, k));
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
      Py_DECREF(t);
      return -1;
    }
    out[k] = (unsigned)v;
  }
  Py_DECREF(t);
  return 0;
}

/* NativePlan(device, n_args, n_outputs, steps, pairs, layers)
 *   steps: [(func, grid, block, smem, pdl, [(arg, off), ...], tail bytes), ...]
 *   pairs: [(i, j, lo_i, hi_i, lo_j, hi_j), ...]
 *   layers: None or (count, strict, [(arg, stride), ...]) */
static PyObject *plan_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  int device, n_args, n_outputs, no_capture = 0;
  PyObject *steps, *pairs, *layers;
  if (!PyArg_ParseTuple(args, "iiiOOO|p", &device, &n_args, &n_outputs, &steps, &pairs, &layers,
                        &no_capture))
    return NULL;
  if (n_args < 0 || n_outputs < 0 || n_args + n_outputs > MAX_ARGS) {
    PyErr_SetString(PyExc_ValueError, "too many arguments for a native plan");
    return NULL;
  }
  NativePlan *self = (NativePlan *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  self->device = device;
  self->no_capture = no_capture;
  self->n_args = n_args;
  self->n_outputs = n_outputs;
  PyObject *seq = PySequence_Fast(steps, "steps must be a sequence");
  if (!seq) goto fail;
  self->n_steps = (int)PySequence_Fast_GET_SIZE(seq);
  self->steps = PyMem_Calloc(self->n_steps ? self->n_steps : 1, sizeof(Step));
  if (!self->steps) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    goto fail;
  }
  for (int s = 0; s < self->n_steps; s++) {
    Step *st = &self->steps[s];
    PyObject *item = PySequence_Fast_GET_ITEM(seq, s);
    PyObject *func = NULL, *grid = NULL, *block = NULL, *slots = NULL, *tail = NULL;
    unsigned smem = 0;
    int pdl = 0;
    if (PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 2) { /* a GEMM: (slots, args) */
      int *g = st->args;
      if (!PyArg_ParseTuple(item, "O(iiiiiiii)", &slots, &g[0], &g[1], &g[2], &g[3], &g[4],
                            &g[5], &g[6], &g[7])) {
        Py_DECREF(seq);
        goto fail;
      }
      if (!cublas_gemm_ex) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a GEMM step before configure_cublas()");
        goto fail;
      }
      st->gemm = 1;
    } else if (!PyArg_ParseTuple(item, "OOOIpOS", &func, &grid, &block, &smem, &pdl, &slots,
                                 &tail)) {
      Py_DECREF(seq);
      goto fail;
    }
    PyObject *sl = PySequence_Fast(slots, "slots must be a sequence");
    if (!sl) {
      Py_DECREF(seq);
      goto fail;
    }
    st->n_ptr = (int)PySequence_Fast_GET_SIZE(sl);
    const char *bad = NULL;
    if (st->gemm) {
      if (st->n_ptr != 3) bad = "a GEMM step has 3 slots";
    } else {
      st->func = PyLong_AsVoidPtr(func);
      if (PyErr_Occurred() || read_uints(grid, st->grid, "grid") ||
          read_uints(block, st->block, "block")) {
        Py_DECREF(sl);
        Py_DECREF(seq);
        goto fail;
      }
      st->smem = smem;
      st->pdl = pdl;
      st->tail_len = PyBytes_GET_SIZE(tail);
      if (8 * (Py_ssize_t)st->n_ptr + st->tail_len > RECORD_MAX)
        bad = "parameter record too large for a native plan";
    }
    if (bad) {
      Py_DECREF(sl);
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, bad);
      goto fail;
    }
    st->slots = PyMem_Calloc(st->n_ptr ? st->n_ptr : 1, sizeof(Slot));
    st->tail = PyMem_Malloc(st->tail_len ? st->tail_len : 1);
    if (!st->slots || !st->tail) {
      Py_DECREF(sl);
      Py_DECREF(seq);
      PyErr_NoMemory();
      goto fail;
    }
    if (tail) memcpy(st->tail, PyBytes_AS_STRING(tail), st->tail_len);
    for (int k = 0; k < st->n_ptr; k++) {
      long long off;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(sl, k), "iL", &st->slots[k].arg, &off)) {
        Py_DECREF(sl);
        Py_DECREF(seq);
        goto fail;
      }
      st->slots[k].off = off;
      if (st->slots[k].arg < (st->gemm ? 0 : -1) || st->slots[k].arg >= n_args + n_outputs) {
        Py_DECREF(sl);
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "slot names no argument");
        goto fail;
      }
    }
    Py_DECREF(sl);
  }
  Py_DECREF(seq);

  seq = PySequence_Fast(pairs, "pairs must be a sequence");
  if (!seq) goto fail;
  self->n_pairs = (int)PySequence_Fast_GET_SIZE(seq);
  self->pairs = PyMem_Calloc(self->n_pairs ? self->n_pairs : 1, sizeof(int64_t[6]));
  if (!self->pairs) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    goto fail;
  }
  for (int p = 0; p < self->n_pairs; p++) {
    long long v[6];
    PyObject *pair = PySequence_Fast_GET_ITEM(seq, p);
    if (PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 6) { /* a first call's: no parser */
      for (int k = 0; k < 6; k++) {
        v[k] = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, k));
        if (v[k] == -1 && PyErr_Occurred()) {
          Py_DECREF(seq);
          goto fail;
        }
      }
    } else if (!PyArg_ParseTuple(pair, "LLLLLL", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5])) {
      Py_DECREF(seq);
      goto fail;
    }
    if (v[0] < 0 || v[0] >= n_args || v[1] < 0 || v[1] >= n_args) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "pair names no argument");
      goto fail;
    }
    for (int k = 0; k < 6; k++) self->pairs[p][k] = v[k];
  }
  Py_DECREF(seq);

  if (layers != Py_None) {
    long long count;
    int strict;
    PyObject *strides;
    if (!PyArg_ParseTuple(layers, "LpO", &count, &strict, &strides)) goto fail;
    seq = PySequence_Fast(strides, "layer strides must be a sequence");
    if (!seq) goto fail;
    self->layer_count = count;
    self->layer_strict = strict;
    self->n_layered = (int)PySequence_Fast_GET_SIZE(seq);
    self->layer_arg = PyMem_Calloc(self->n_layered ? self->n_layered : 1, sizeof(int));
    self->layer_stride = PyMem_Calloc(self->n_layered ? self->n_layered : 1, sizeof(int64_t));
    if (!self->layer_arg || !self->layer_stride) {
      Py_DECREF(seq);
      PyErr_NoMemory();
      goto fail;
    }
    for (int k = 0; k < self->n_layered; k++) {
      long long stride;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "iL", &self->layer_arg[k],
                            &stride)) {
        Py_DECREF(seq);
        goto fail;
      }
      if (self->layer_arg[k] < 0 || self->layer_arg[k] >= n_args) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "layer stride names no argument");
        goto fail;
      }
      self->layer_stride[k] = stride;
    }
    Py_DECREF(seq);
  }
  return (PyObject *)self;
fail:
  Py_DECREF(self);
  return NULL;
}

static PyTypeObject NativePlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ropekv._native_ext.NativePlan",
    .tp_basicsize = sizeof(NativePlan),
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A launch plan's launches as C data (built by ropekv._launch; no Python API).",
    .tp_new = plan_new,
};

/* ---- the call ------------------------------------------------------------------------------- */

/* The Python objects the replay uses, handed to Caller() by ropekv._launch.native_hooks() (a
 * tuple in this order; its comments say what each is): nothing is looked up by name. */
enum {
  H_TYPES,          /* [cupy.ndarray, torch.Tensor]: a list, each filled once seen */
  H_CUPY_STREAM,    /* current_stream_ptr(device): CuPy's current stream */
  H_TORCH_STREAM,   /* _torch_stream_ptr(device): torch's current stream */
  H_CAPTURING,      /* stream_capturing(stream): whether it captures a CUDA graph */
  H_RUNTIME,        /* [runtime]: a list, CuPy's runtime module once bound (else None) */
  H_DRIVER_FAILED,  /* _driver_failed(code): raises a failed launch's error */
  H_CUBLAS_HANDLE,  /* _cublas_handle(): the calling thread's cuBLAS handle */
  H_CUBLAS_FAILED,  /* _cublas_failed(status): raises a failed cuBLAS call's error */
  H_NEW_LAYOUT,     /* _NewLayout(layout): a call read whole whose layout has no plan */
  H_NP_BOOL,        /* numpy.bool_ (never a normal key value) */
  H_NP_DTYPE,       /* numpy.dtype (a normal dtype-like value) */
  N_HOOKS
};

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall; /* caller_call: the type's instances are called through it */
  PyObject *names;        /* the op's argument names (Plan.replay's error messages) */
  PyObject *kinds;        /* how each scalar argument enters the key (Op.flag_kinds), or None */
  PyObject *hooks[N_HOOKS]; /* what ropekv._launch.native_hooks() hands it, in that order */
  PyObject *miss;           /* the answer "take the Python path" */
} Caller;

static PyObject *caller_call(Caller *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames);

static void caller_dealloc(Caller *self) {
  Py_XDECREF(self->names);
  Py_XDECREF(self->kinds);
  for (int k = 0; k < N_HOOKS; k++) Py_XDECREF(self->hooks[k]);
  Py_XDECREF(self->miss);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *caller_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  PyObject *names, *kinds, *hooks, *miss;
  if (!PyArg_ParseTuple(args, "O!OO!O", &PyTuple_Type, &names, &kinds, &PyTuple_Type, &hooks,
                        &miss))
    return NULL;
  if (kinds != Py_None && !PyTuple_CheckExact(kinds)) {
    PyErr_SetString(PyExc_TypeError, "kinds must be a tuple of ints or None");
    return NULL;
  }
  if (PyTuple_GET_SIZE(hooks) != N_HOOKS ||
      !PyList_CheckExact(PyTuple_GET_ITEM(hooks, H_TYPES)) ||
      PyList_GET_SIZE(PyTuple_GET_ITEM(hooks, H_TYPES)) != 2 ||
      !PyList_CheckExact(PyTuple_GET_ITEM(hooks, H_RUNTIME)) ||
      !PyType_Check(PyTuple_GET_ITEM(hooks, H_NP_BOOL)) ||
      !PyType_Check(PyTuple_GET_ITEM(hooks, H_NP_DTYPE))) {
    PyErr_Format(PyExc_TypeError, "hooks must be ropekv._launch.native_hooks() (%d entries)",
                 N_HOOKS);
    return NULL;
  }
  Caller *self = (Caller *)type->tp_alloc(type, 0);
  if (!self) return NULL;
  Py_INCREF(kinds);
  self->kinds = kinds;
  Py_INCREF(names);
  Py_INCREF(miss);
  self->names = names;
  for (int k = 0; k < N_HOOKS; k++) {
    self->hooks[k] = PyTuple_GET_ITEM(hooks, k);
    Py_INCREF(self->hooks[k]);
  }
  self->miss = miss;
  self->vectorcall = (vectorcallfunc)caller_call;
  return (PyObject *)self;
}

/* *out = the int `o` (a new reference, consumed; NULL: an error is set). */
static int as_u64(PyObject *o, uint64_t *out) {
  if (!o) return -1;
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  Py_DECREF(o);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
  *out = v;
  return 0;
}

static int as_u64_borrowed(PyObject *o, uint64_t *out) {
  Py_INCREF(o);
  return as_u64(o, out);
}

/* The alignment entry of a key (_arrays.align_key): the pointer's offset from 16 bytes, or 16 for
 * a null pointer, which no plan of a non-empty array is keyed by (a first call refuses it), so a
 * null pointer never replays a plan validated on an aligned one. */
static long align_key(uint64_t ptr) { return ptr ? (long)(ptr & 15) : 16; }

/* The layout key of one argument (as _arrays.signature builds it) and its pointer; NULL with
 * no error set: not a CuPy array nor a torch tensor of the base type (the Python path reads it). */
static PyObject *read_array(PyObject *a, PyObject *cupy_cls, PyObject *torch_cls, uint64_t *ptr,
                            int *kinds) {
  PyObject *cls = (PyObject *)Py_TYPE(a);
  if (cls == cupy_cls) {
    PyObject *data = PyObject_GetAttr(a, s_data);
    if (!data) return NULL;
    PyObject *p = PyObject_GetAttr(data, s_ptr);
    PyObject *dev = p ? PyObject_GetAttr(data, s_device_id) : NULL;
    Py_DECREF(data);
    if (!dev || as_u64(p, ptr)) {
      Py_XDECREF(dev);
      return NULL;
    }
    PyObject *shape = PyObject_GetAttr(a, s_shape);
    PyObject *strides = shape ? PyObject_GetAttr(a, s_strides) : NULL;
    PyObject *dtype = strides ? PyObject_GetAttr(a, s_dtype) : NULL;
    PyObject *align = dtype ? PyLong_FromLong(align_key(*ptr)) : NULL;
    PyObject *key = align ? PyTuple_Pack(5, shape, strides, dtype, align, dev) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(align);
    Py_DECREF(dev);
    *kinds |= CUPY;
    return key;
  }
  if (cls == torch_cls) {
    /* a lazy negation is not in the key: such a tensor goes to the first-call path, which
       refuses it (the struct reads refuse it by its key set) */
    PyObject *neg = PyObject_CallMethodNoArgs(a, s_is_neg);
    if (!neg) return NULL;
    int negated = PyObject_IsTrue(neg);
    Py_DECREF(neg);
    if (negated) return NULL; /* -1: its error; 1: a miss */
    if (as_u64(PyObject_CallMethodNoArgs(a, s_data_ptr), ptr)) {
      /* a tensor without storage (sparse, nested, ...): the first-call path names it */
      if (PyErr_ExceptionMatches(PyExc_RuntimeError)) PyErr_Clear();
      return NULL;
    }
    PyObject *cuda = PyObject_GetAttr(a, s_is_cuda); /* a device of another type: not CUDA */
    PyObject *shape = cuda ? PyObject_GetAttr(a, s_shape) : NULL;
    PyObject *stride = shape ? PyObject_CallMethodNoArgs(a, s_stride) : NULL;
    PyObject *dtype = stride ? PyObject_GetAttr(a, s_dtype) : NULL;
    PyObject *align = dtype ? PyLong_FromLong(align_key(*ptr)) : NULL;
    PyObject *dev = align ? PyObject_CallMethodNoArgs(a, s_get_device) : NULL;
    PyObject *key = dev ? PyTuple_Pack(6, cuda, shape, stride, dtype, align, dev) : NULL;
    Py_XDECREF(cuda);
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    Py_XDECREF(dtype);
    Py_XDECREF(align);
    Py_XDECREF(dev);
    if (!key && PyErr_ExceptionMatches(PyExc_RuntimeError)) PyErr_Clear(); /* as above */
    *kinds |= TORCH;
    return key;
  }
  return NULL;
}

/* ---- CuPy arrays read from their object struct ------------------------------------------------
 * A cupy.ndarray's pointer, shape, strides and dtype through its attributes cost about 0.3 us
 * (two tuples built per call); read from the object they cost a few nanoseconds. CuPy declares the
 * struct in cupy/_core/core.pxd (size, then the shape and strides as std::vector<Py_ssize_t>, the
 * dtype and the MemoryPointer `data`, whose first field is `ptr`); ropekv/_native.py finds the
 * offsets on arrays it makes (matching the values the attributes give), checks this file's reads
 * against the attributes on several layouts, and only then configures them here. Only the exact
 * types so configured are read this way; anything else goes through the attributes. */

typedef struct {
  PyObject *array_type;   /* cupy.ndarray (a strong reference), or NULL: raw reads are off */
  PyObject *pointer_type; /* cupy.cuda.memory.MemoryPointer */
  Py_ssize_t shape, strides, dtype, data, ptr; /* byte offsets: (begin, end) pairs for the two
                                                  vectors, object pointers, the intptr_t ptr */
} RawCupy;

static RawCupy raw = {NULL, NULL, 0, 0, 0, 0, 0};

/* ---- torch tensors read from their TensorImpl -------------------------------------------------
 * A torch.Tensor's data_ptr(), shape, stride(), dtype and get_device() cost about 0.45 us per
 * tensor on the H200's host (five calls, two tuples built); the values sit in the tensor's C++
 * TensorImpl, which the Python object holds (torch >= 2.10: an at::Tensor, one pointer). The
 * offsets are torch's C++ ABI, so none is written here: ropekv/_native.py finds each on tensors it
 * makes (the one place that holds what the attributes give), checks these reads against the
 * attributes and checks that the tensors it must leave to the attributes are left to them, and
 * only then configures them. A tensor is read this way only when it is of the exact configured
 * type, its dispatch key set is the plain dense one of the probes (no Python subclass or mode key,
 * no functionalization, batching, lazy negation or conjugation, no inference tensor), it is on a
 * device of the configured type, its dtype is one of the probed ones, and its storage has no
 * mutable-data-pointer check (copy-on-write storages and storages that must not be written give
 * the pointer through data_ptr(), which materializes or raises). Anything else: the attributes. */

#define RAW_DTYPES 32

typedef struct {
  PyObject *tensor_type; /* torch.Tensor (a strong reference), or NULL: raw reads are off */
  Py_ssize_t impl;       /* the TensorImpl pointer, in the Python object */
  /* in the TensorImpl: the storage pointer, the ndim word (the sizes follow it, inline up to
   * `cap` dimensions and then the strides; beyond, a pointer to sizes then strides), the storage
   * offset and numel words, the dtype's uint16 index, the device bytes (type, index, engaged) and
   * the dispatch key set */
  Py_ssize_t storage, ndim, cap, offset, numel, dtype, device, keyset;
  Py_ssize_t data, check; /* in the StorageImpl: the data pointer, the mutable-data check byte */
  uint64_t keyset_value;
  int device_type;
  int live; /* 0: configured but not verified yet (only raw_layout(a, True) reads this way) */
  int n_dtypes;
  unsigned dtype_index[RAW_DTYPES];
  int64_t itemsize[RAW_DTYPES];
  PyObject *dtypes[RAW_DTYPES]; /* strong references */
} RawTorch;

static RawTorch rt;

typedef struct {
  const Py_ssize_t *shape, *strides;
  Py_ssize_t ndim;
  PyObject *dtype, *data; /* borrowed; data: a CuPy array's MemoryPointer, NULL for a tensor */
  int torch, device;      /* a torch tensor, and its device index */
  Py_ssize_t item;        /* a tensor's item size (0 for a CuPy array: its dtype says) */
  uint64_t ptr;
} RawView;

#define AT(obj, off, type) (*(type *)((char *)(obj) + (off)))

/* 1: the torch tensor `a` read into *v; 0: not readable this way (the attributes are). */
static int torch_view(PyObject *a, RawView *v) {
  const char *impl = AT(a, rt.impl, const char *);
  if (!impl || AT(impl, rt.keyset, uint64_t) != rt.keyset_value) return 0;
  const unsigned char *dev = (const unsigned char *)impl + rt.device;
  if (dev[0] != rt.device_type || dev[2] != 1) return 0;
  unsigned index = AT(impl, rt.dtype, uint16_t);
  int d = 0;
  while (d < rt.n_dtypes && rt.dtype_index[d] != index) d++;
  const char *storage = AT(impl, rt.storage, const char *);
  if (d == rt.n_dtypes || !storage || AT(storage, rt.check, unsigned char)) return 0;
  Py_ssize_t ndim = AT(impl, rt.ndim, Py_ssize_t);
  if (ndim < 0 || ndim > 64) return 0;
  if (ndim <= rt.cap) {
    v->shape = (const Py_ssize_t *)(impl + rt.ndim + 8);
    v->strides = v->shape + rt.cap;
  } else {
    v->shape = AT(impl, rt.ndim + 8, const Py_ssize_t *);
    if (!v->shape) return 0;
    v->strides = v->shape + ndim;
  }
  v->ndim = ndim;
  v->dtype = rt.dtypes[d];
  v->data = NULL;
  v->torch = 1;
  v->device = (signed char)dev[1]; /* -1: none (a CPU tensor) */
  v->item = (Py_ssize_t)rt.itemsize[d];
  /* TensorImpl::data(): null for an empty tensor, else the storage's data plus the offset; a
   * storage without data (resized to 0 bytes) gives null whatever the offset (data_ptr() would
   * give the offset alone), which no plan of a non-empty tensor is keyed by */
  uintptr_t base = AT(storage, rt.data, uintptr_t);
  v->ptr = AT(impl, rt.numel, int64_t) == 0 || !base
               ? 0
               : (uint64_t)base + (uint64_t)(AT(impl, rt.offset, int64_t) * rt.itemsize[d]);
  return 1;
}

/* ---- torch tensors read through torch's DLPack C exchange API --------------------------------
 * torch.Tensor.__dlpack_c_exchange_api__ (a PyCapsule "dlpack_exchange_api" of a DLPackExchangeAPI,
 * DLPack 1.x, ATen/dlpack.h) fills a caller's DLTensor from a tensor without the Python API:
 * torch's supported interface for what the TensorImpl reads above do. It does not refuse a lazy
 * negation (the DLTensor has no such bit), so a tensor with one is left to the attributes (an
 * is_neg() call); any failure of the export (no storage, a tensor that must not be written, a
 * device DLPack has no code for) clears its error and leaves the tensor to the attributes too.
 * Only the exact configured type, on the configured DLPack device type, of a probed dtype, with
 * one lane and no byte offset is read this way. */

typedef struct { /* DLTensor (DLPack 1.x) */
  void *data;
  int32_t device_type, device_id;
  int32_t ndim;
  uint8_t code, bits;
  uint16_t lanes;
  int64_t *shape, *strides;
  uint64_t byte_offset;
} DLTensorV1;

typedef int (*dltensor_from_py_fn)(void *py_object, DLTensorV1 *out);

static PyObject *ssize_tuple(const Py_ssize_t *values, Py_ssize_t n);

typedef struct {
  PyObject *tensor_type; /* torch.Tensor (a strong reference), or NULL: off */
  PyObject *capsule;     /* the API's capsule (a strong reference: the table lives with it) */
  dltensor_from_py_fn from_py;
  int device_type; /* the DLPack device type read (kDLCUDA = 2; kDLCPU = 1 in tests) */
  int n_dtypes;
  unsigned dl_dtype[RAW_DTYPES]; /* code | bits << 8 */
  int64_t itemsize[RAW_DTYPES];
  PyObject *dtypes[RAW_DTYPES]; /* strong references */
} RawExchange;

static RawExchange rx;

/* 1: the torch tensor `a` read into *v through the exchange API; 0: left to the attributes; -1:
 * an error of is_neg() (set). */
static int exchange_view(PyObject *a, RawView *v) {
  DLTensorV1 t;
  if (rx.from_py(a, &t)) {
    PyErr_Clear();
    return 0;
  }
  if (t.device_type != rx.device_type || t.lanes != 1 || t.byte_offset || t.ndim < 0 ||
      t.ndim > 64 || (t.ndim && (!t.shape || !t.strides)))
    return 0;
  unsigned code = t.code | (unsigned)t.bits << 8;
  int d = 0;
  while (d < rx.n_dtypes && rx.dl_dtype[d] != code) d++;
  if (d == rx.n_dtypes) return 0;
  PyObject *neg = PyObject_CallMethodNoArgs(a, s_is_neg);
  if (!neg) return -1;
  int negated = PyObject_IsTrue(neg);
  Py_DECREF(neg);
  if (negated) return negated < 0 ? -1 : 0;
  v->shape = (const Py_ssize_t *)t.shape;
  v->strides = (const Py_ssize_t *)t.strides;
  v->ndim = t.ndim;
  v->dtype = rx.dtypes[d];
  v->data = NULL;
  v->torch = 1;
  v->device = rx.device_type == 2 ? t.device_id : -1; /* get_device(): -1 for a CPU tensor */
  v->item = (Py_ssize_t)rx.itemsize[d];
  v->ptr = (uint64_t)(uintptr_t)t.data;
  return 1;
}

static void exchange_off(void) {
  Py_CLEAR(rx.tensor_type);
  Py_CLEAR(rx.capsule);
  rx.from_py = NULL;
  for (int d = 0; d < rx.n_dtypes; d++) Py_CLEAR(rx.dtypes[d]);
  rx.n_dtypes = 0;
}

/* configure_exchange(tensor_type, capsule, dl_device_type, ((code, bits, dtype, itemsize), ...))
 * or configure_exchange(None): torch tensors read through the DLPack exchange API, or not.
 * ValueError when the capsule is not a DLPack 1.x exchange API with a DLTensor export. */
static PyObject *configure_exchange(PyObject *mod, PyObject *args) {
  PyObject *tensor_type, *capsule = NULL, *dtypes = NULL;
  int device_type = 0;
  if (!PyArg_ParseTuple(args, "O|OiO!", &tensor_type, &capsule, &device_type, &PyTuple_Type,
                        &dtypes))
    return NULL;
  exchange_off();
  if (tensor_type == Py_None) Py_RETURN_NONE;
  if (!PyType_Check(tensor_type) || !dtypes || PyTuple_GET_SIZE(dtypes) > RAW_DTYPES) {
    PyErr_SetString(PyExc_TypeError, "configure_exchange takes a type, a capsule, a DLPack "
                                     "device type and dtypes");
    return NULL;
  }
  const unsigned char *api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  if (!api) return NULL;
  /* DLPackExchangeAPI: header {version {major, minor}, prev_api}, then the allocator, managed
   * from / to Python, DLTensor from Python (may be NULL), current work stream */
  uint32_t major = *(const uint32_t *)api;
  dltensor_from_py_fn fn = *(dltensor_from_py_fn const *)(api + 16 + 3 * sizeof(void *));
  if (major != 1 || !fn) {
    PyErr_Format(PyExc_ValueError,
                 "the exchange API is DLPack %u.x%s (this reader takes 1.x with a DLTensor export)",
                 major, fn ? "" : " without a DLTensor export");
    return NULL;
  }
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(dtypes); d++) {
    unsigned code, bits;
    PyObject *dtype;
    long long itemsize;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(dtypes, d), "IIOL", &code, &bits, &dtype, &itemsize)) {
      exchange_off();
      return NULL;
    }
    if (code > 255 || bits > 255 || itemsize < 1 || itemsize > 16) {
      exchange_off();
      PyErr_SetString(PyExc_ValueError, "configure_exchange: a dtype out of range");
      return NULL;
    }
    Py_INCREF(dtype);
    rx.dtypes[d] = dtype;
    rx.dl_dtype[d] = code | bits << 8;
    rx.itemsize[d] = itemsize;
    rx.n_dtypes = (int)d + 1;
  }
  Py_INCREF(capsule);
  rx.capsule = capsule;
  rx.from_py = fn;
  rx.device_type = device_type;
  Py_INCREF(tensor_type);
  rx.tensor_type = tensor_type;
  Py_RETURN_NONE;
}

/* dl_read(a) -> (data, device type, device id, (code, bits, lanes), shape, strides, byte offset)
 * of a tensor through the configured exchange API (the probe of its dtypes), or None. */
static PyObject *dl_read(PyObject *mod, PyObject *a) {
  if (!rx.from_py || (PyObject *)Py_TYPE(a) != rx.tensor_type) Py_RETURN_NONE;
  DLTensorV1 t;
  if (rx.from_py(a, &t)) return NULL;
  PyObject *shape = ssize_tuple((const Py_ssize_t *)t.shape, t.ndim);
  PyObject *strides = shape ? ssize_tuple((const Py_ssize_t *)t.strides, t.ndim) : NULL;
  PyObject *r = strides ? Py_BuildValue("(Kii(iii)OOK)", (unsigned long long)(uintptr_t)t.data,
                                        t.device_type, t.device_id, t.code, t.bits, t.lanes,
                                        shape, strides, (unsigned long long)t.byte_offset)
                        : NULL;
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  return r;
}

/* 1: `a` (a CuPy array or a torch tensor of a configured type) read into *v; 0: not readable this
 * way (the attributes are); -1: an error (set). */
static int raw_view(PyObject *a, RawView *v) {
  PyObject *cls = (PyObject *)Py_TYPE(a);
  if (cls == rx.tensor_type) return exchange_view(a, v);
  if (cls == rt.tensor_type) return rt.live && torch_view(a, v);
  if (!raw.array_type || cls != raw.array_type) return 0;
  const Py_ssize_t *sb = AT(a, raw.shape, const Py_ssize_t *),
                   *se = AT(a, raw.shape + 8, const Py_ssize_t *),
                   *tb = AT(a, raw.strides, const Py_ssize_t *),
                   *te = AT(a, raw.strides + 8, const Py_ssize_t *);
  Py_ssize_t ndim = se - sb;
  PyObject *data = AT(a, raw.data, PyObject *), *dtype = AT(a, raw.dtype, PyObject *);
  if (ndim < 0 || ndim > 64 /* CuPy's MAX_NDIM */ || te - tb != ndim || !data || !dtype ||
      (PyObject *)Py_TYPE(data) != raw.pointer_type)
    return 0;
  v->shape = sb;
  v->strides = tb;
  v->ndim = ndim;
  v->dtype = dtype;
  v->data = data;
  v->torch = 0;
  v->device = -1;
  v->item = 0;
  v->ptr = (uint64_t)AT(data, raw.ptr, intptr_t);
  return 1;
}

static PyObject *ssize_tuple(const Py_ssize_t *values, Py_ssize_t n) {
  PyObject *t = PyTuple_New(n);
  for (Py_ssize_t i = 0; t && i < n; i++) {
    PyObject *x = PyLong_FromSsize_t(values[i]);
    if (!x) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, i, x);
  }
  return t;
}

/* The device of a raw view, as its key holds it (a new reference). */
static PyObject *raw_device(const RawView *v) {
  return v->torch ? PyLong_FromLong(v->device) : PyObject_GetAttr(v->data, s_device_id);
}

/* The key of a raw view, as read_array builds it from the attributes. */
static PyObject *raw_key(const RawView *v) {
  PyObject *dev = raw_device(v);
  PyObject *shape = dev ? ssize_tuple(v->shape, v->ndim) : NULL;
  PyObject *strides = shape ? ssize_tuple(v->strides, v->ndim) : NULL;
  PyObject *align = strides ? PyLong_FromLong(align_key(v->ptr)) : NULL;
  PyObject *key = !align   ? NULL
                  : v->torch ? PyTuple_Pack(6, v->device >= 0 ? Py_True : Py_False, shape, strides,
                                            v->dtype, align, dev)
                             : PyTuple_Pack(5, shape, strides, v->dtype, align, dev);
  Py_XDECREF(dev);
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(align);
  return key;
}

/* 1 when the tuple `t` (a torch.Size too) holds exactly these ints. */
static int ssize_tuple_equals(PyObject *t, const Py_ssize_t *values, Py_ssize_t n) {
  if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) return 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *x = PyTuple_GET_ITEM(t, i);
    if (!PyLong_CheckExact(x)) return 0;
    Py_ssize_t value = PyLong_AsSsize_t(x);
    if (value == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return 0;
    }
    if (value != values[i]) return 0;
  }
  return 1;
}

/* 1 when the key read_array would build for the raw view equals `entry` (a key of an earlier
 * call), 0 when not, -1 on error; it builds no key. */
static int raw_key_equals(const RawView *v, PyObject *entry) {
  Py_ssize_t at = v->torch; /* a tensor's key starts with its is_cuda (a CUDA tensor has a device
                               index; a CPU one, read through the exchange API in tests, -1) */
  if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 + at) return 0;
  PyObject *is_cuda = v->device >= 0 ? Py_True : Py_False;
  if (at && PyTuple_GET_ITEM(entry, 0) != is_cuda) {
    int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 0), is_cuda, Py_EQ);
    if (same <= 0) return same;
  }
  if (!ssize_tuple_equals(PyTuple_GET_ITEM(entry, at), v->shape, v->ndim) ||
      !ssize_tuple_equals(PyTuple_GET_ITEM(entry, at + 1), v->strides, v->ndim))
    return 0;
  PyObject *align = PyTuple_GET_ITEM(entry, at + 3);
  if (!PyLong_CheckExact(align) || PyLong_AsLong(align) != align_key(v->ptr)) return 0;
  PyObject *dtype = PyTuple_GET_ITEM(entry, at + 2);
  if (dtype != v->dtype) {
    int same = PyObject_RichCompareBool(dtype, v->dtype, Py_EQ);
    if (same <= 0) return same;
  }
  PyObject *want = PyTuple_GET_ITEM(entry, at + 4);
  if (v->torch) return PyLong_CheckExact(want) && PyLong_AsLong(want) == v->device;
  PyObject *dev = raw_device(v);
  if (!dev) return -1;
  int same = PyObject_RichCompareBool(dev, want, Py_EQ);
  Py_DECREF(dev);
  return same;
}

/* configure_cupy(array_type, pointer_type, shape, strides, dtype, data, ptr) or
 * configure_cupy(None): raw reads of CuPy arrays on (offsets found by _native.py) or off. */
static PyObject *configure_cupy(PyObject *mod, PyObject *args) {
  PyObject *array_type, *pointer_type = Py_None;
  Py_ssize_t off[5] = {0, 0, 0, 0, 0};
  if (!PyArg_ParseTuple(args, "O|Onnnnn", &array_type, &pointer_type, &off[0], &off[1], &off[2],
                        &off[3], &off[4]))
    return NULL;
  Py_CLEAR(raw.array_type);
  Py_CLEAR(raw.pointer_type);
  if (array_type == Py_None) Py_RETURN_NONE;
  if (!PyType_Check(array_type) || !PyType_Check(pointer_type)) {
    PyErr_SetString(PyExc_TypeError, "configure_cupy takes two types and five offsets");
    return NULL;
  }
  Py_ssize_t sizes[2] = {((PyTypeObject *)array_type)->tp_basicsize,
                         ((PyTypeObject *)pointer_type)->tp_basicsize};
  if (off[0] < 16 || off[0] + 16 > sizes[0] || off[1] < 16 || off[1] + 16 > sizes[0] ||
      off[2] < 16 || off[2] + 8 > sizes[0] || off[3] < 16 || off[3] + 8 > sizes[0] ||
      off[4] < 16 || off[4] + 8 > sizes[1] || (off[0] | off[1] | off[2] | off[3] | off[4]) & 7) {
    PyErr_SetString(PyExc_ValueError, "configure_cupy: an offset outside the struct");
    return NULL;
  }
  Py_INCREF(array_type);
  Py_INCREF(pointer_type);
  raw.array_type = array_type;
  raw.pointer_type = pointer_type;
  raw.shape = off[0];
  raw.strides = off[1];
  raw.dtype = off[2];
  raw.data = off[3];
  raw.ptr = off[4];
  Py_RETURN_NONE;
}

static void torch_off(void) {
  rt.live = 0;
  Py_CLEAR(rt.tensor_type);
  for (int d = 0; d < rt.n_dtypes; d++) Py_CLEAR(rt.dtypes[d]);
  rt.n_dtypes = 0;
}

#define TORCH_STRUCT_MAX 1024 /* bytes: every TensorImpl / StorageImpl offset lies below this */

/* configure_torch(tensor_type, (impl, storage, ndim, cap, offset, numel, dtype, device, keyset,
 * data, check), keyset_value, device_type, ((dtype index, dtype, itemsize), ...)) or
 * configure_torch(None): raw reads of torch tensors on (all found by _native.py) or off. */
static PyObject *configure_torch(PyObject *mod, PyObject *args) {
  PyObject *tensor_type, *dtypes = NULL;
  Py_ssize_t o[11];
  unsigned long long keyset = 0;
  int device_type = 0;
  if (!PyArg_ParseTuple(args, "O|(nnnnnnnnnnn)KiO!", &tensor_type, &o[0], &o[1], &o[2], &o[3],
                        &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10], &keyset, &device_type,
                        &PyTuple_Type, &dtypes))
    return NULL;
  torch_off();
  if (tensor_type == Py_None) Py_RETURN_NONE;
  if (!PyType_Check(tensor_type) || !dtypes) {
    PyErr_SetString(PyExc_TypeError, "configure_torch takes a type, offsets, a key set, a device "
                                     "type and dtypes");
    return NULL;
  }
  Py_ssize_t basic = ((PyTypeObject *)tensor_type)->tp_basicsize;
  int bad = o[0] < 16 || o[0] + 8 > basic || o[0] & 7 || o[3] < 1 || o[3] > 16 ||
            device_type < 0 || device_type > 127 || PyTuple_GET_SIZE(dtypes) > RAW_DTYPES;
  for (int k = 1; k < 11; k++) {
    if (k == 3) continue;
    Py_ssize_t end = o[k] + (k == 2 ? 8 * (1 + 2 * o[3]) : k == 6 ? 2 : k == 7 ? 3 : k == 10 ? 1 : 8);
    int align = k == 6 ? 1 : k == 7 || k == 10 ? 0 : 7;
    bad |= o[k] < 8 || end > TORCH_STRUCT_MAX || (o[k] & align);
  }
  if (bad) {
    PyErr_SetString(PyExc_ValueError, "configure_torch: an offset outside the struct");
    return NULL;
  }
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(dtypes); d++) {
    unsigned index;
    PyObject *dtype;
    long long itemsize;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(dtypes, d), "IOL", &index, &dtype, &itemsize)) {
      torch_off();
      return NULL;
    }
    if (index > 0xffff || itemsize < 1 || itemsize > 16) {
      torch_off();
      PyErr_SetString(PyExc_ValueError, "configure_torch: a dtype index or itemsize out of range");
      return NULL;
    }
    Py_INCREF(dtype);
    rt.dtypes[d] = dtype;
    rt.dtype_index[d] = index;
    rt.itemsize[d] = itemsize;
    rt.n_dtypes = (int)d + 1;
  }
  rt.impl = o[0];
  rt.storage = o[1];
  rt.ndim = o[2];
  rt.cap = o[3];
  rt.offset = o[4];
  rt.numel = o[5];
  rt.dtype = o[6];
  rt.device = o[7];
  rt.keyset = o[8];
  rt.data = o[9];
  rt.check = o[10];
  rt.keyset_value = keyset;
  rt.device_type = device_type;
  rt.live = 0; /* staged: enable_torch() turns the reads on once _native.py has verified them */
  Py_INCREF(tensor_type);
  rt.tensor_type = tensor_type;
  Py_RETURN_NONE;
}

/* enable_torch(): the staged torch reads (configure_torch) go live. */
static PyObject *enable_torch(PyObject *mod, PyObject *unused) {
  if (!rt.tensor_type) {
    PyErr_SetString(PyExc_ValueError, "enable_torch: no torch reads configured");
    return NULL;
  }
  rt.live = 1;
  Py_RETURN_NONE;
}

/* raw_layout(a, staged=False) -> (shape, strides, dtype, ptr, device) read from a CuPy array's or
 * a torch tensor's struct (device: a tensor's index, -1 for a CuPy array), or None (not readable
 * so). staged: read a torch tensor with the configured reads before they go live (the probe). */
static PyObject *raw_layout(PyObject *mod, PyObject *args) {
  PyObject *a;
  int staged = 0;
  if (!PyArg_ParseTuple(args, "O|p", &a, &staged)) return NULL;
  RawView v;
  int readable = staged && rt.tensor_type && (PyObject *)Py_TYPE(a) == rt.tensor_type
                     ? torch_view(a, &v)
                     : raw_view(a, &v);
  if (readable < 0) return NULL;
  if (!readable) Py_RETURN_NONE;
  PyObject *shape = ssize_tuple(v.shape, v.ndim);
  PyObject *strides = shape ? ssize_tuple(v.strides, v.ndim) : NULL;
  PyObject *ptr = strides ? PyLong_FromUnsignedLongLong(v.ptr) : NULL;
  PyObject *r = ptr ? Py_BuildValue("(OOOOi)", shape, strides, v.dtype, ptr, v.device) : NULL;
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(ptr);
  return r;
}

/* view_fields(a) -> (ptr, shape, element strides, dtype, device, size, lo, hi) of a CuPy array or
 * torch tensor read from its struct, as _arrays builds an ArrayView of it (dtype: the array's own,
 * a NumPy or torch dtype; [lo, hi): the bytes it touches relative to ptr), or None: not readable
 * so, or a CuPy byte stride that is no multiple of the item size (the attributes say which). */
static PyObject *view_fields(PyObject *mod, PyObject *a) {
  RawView v;
  int readable = raw_view(a, &v);
  if (readable < 0) return NULL;
  if (!readable) Py_RETURN_NONE;
  Py_ssize_t item;
  if (v.torch) {
    item = v.item;
  } else {
    PyObject *it = PyObject_GetAttr(v.dtype, s_itemsize);
    item = it ? PyLong_AsSsize_t(it) : -1;
    Py_XDECREF(it);
    if (item == -1 && PyErr_Occurred()) return NULL;
    if (item <= 0) Py_RETURN_NONE;
  }
  PyObject *shape = ssize_tuple(v.shape, v.ndim), *strides = shape ? PyTuple_New(v.ndim) : NULL;
  Py_ssize_t size = 1, lo = 0, hi = 0;
  for (Py_ssize_t k = 0; strides && k < v.ndim; k++) {
    Py_ssize_t n = v.shape[k], st = v.strides[k], bytes;
    if (v.torch) {
      bytes = st * item;
    } else {
      if (st % item) {
        Py_DECREF(shape);
        Py_DECREF(strides);
        Py_RETURN_NONE;
      }
      bytes = st;
      st /= item;
    }
    PyObject *x = PyLong_FromSsize_t(st);
    if (!x) {
      Py_CLEAR(strides);
      break;
    }
    PyTuple_SET_ITEM(strides, k, x);
    size *= n;
    if (bytes < 0)
      lo += (n - 1) * bytes;
    else
      hi += (n - 1) * bytes;
  }
  PyObject *dev = strides ? raw_device(&v) : NULL;
  PyObject *r = dev ? Py_BuildValue("(KOOOOnnn)", (unsigned long long)v.ptr, shape, strides,
                                    v.dtype, dev, size, lo, hi + item)
                    : NULL;
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(dev);
  return r;
}

/* ---- a first call's arguments read into ArrayViews (_arrays.read_arguments) ---------------------
 * configure_views(ArrayView) finds the byte offset of each slot of _arrays.ArrayView in its
 * instances (its __slots__' member descriptors); read_views then builds a first call's views here,
 * with the values _arrays._struct_view gives them, for calls whose every array is None, a CuPy
 * array or a torch tensor readable from its struct (on a device whose torch reads _arrays
 * verified). Any other argument, a null pointer of a non-empty array, or a CuPy byte stride that
 * is no multiple of the item size: None, and the Python loop reads the call (and raises what it
 * raises). */

enum { V_ARRAY, V_DEVICE, V_DTYPE, V_HOST, V_LEGACY, V_NAME, V_OWNER, V_PTR, V_READONLY, V_SHAPE,
       V_SIZE, V_SPAN, V_STRIDES, V_SLOTS };
static const char *const view_slot_names[V_SLOTS] = {
    "array", "device", "dtype", "host", "legacy", "name", "owner",
    "ptr", "readonly", "shape", "size", "span", "strides"};
static PyTypeObject *view_type = NULL; /* a strong reference once configured */
static Py_ssize_t view_offsets[V_SLOTS];

static PyObject *configure_views(PyObject *mod, PyObject *type) {
  if (!PyType_Check(type)) {
    PyErr_SetString(PyExc_TypeError, "configure_views takes the ArrayView class");
    return NULL;
  }
  Py_ssize_t offsets[V_SLOTS];
  for (int k = 0; k < V_SLOTS; k++) {
    PyObject *d = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, view_slot_names[k]);
    if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
      PyErr_Format(PyExc_TypeError, "ArrayView has no slot %s", view_slot_names[k]);
      return NULL;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY)) {
      PyErr_Format(PyExc_TypeError, "ArrayView's %s is no plain object slot", view_slot_names[k]);
      return NULL;
    }
    offsets[k] = m->offset;
  }
  memcpy(view_offsets, offsets, sizeof offsets);
  Py_INCREF(type);
  PyTypeObject *old = view_type;
  view_type = (PyTypeObject *)type;
  Py_XDECREF(old);
  Py_RETURN_NONE;
}

/* Store `value` (a new reference, or NULL: an error set) in slot k of view v; -1 on NULL. */
static int view_set(PyObject *v, int k, PyObject *value) {
  if (!value) return -1;
  PyObject **slot = (PyObject **)((char *)v + view_offsets[k]), *old = *slot;
  *slot = value;
  Py_XDECREF(old);
  return 0;
}

/* Store `value` (borrowed) in slot k of view v. */
static void view_put(PyObject *v, int k, PyObject *value) {
  Py_INCREF(value);
  view_set(v, k, value);
}

/* The ArrayView of raw view r of array `a` named `name` (dtype: its NumPy dtype, borrowed);
 * Py_None (a new reference) where the Python loop must read it; NULL: an error. *misaligned is set
 * where the pointer is no multiple of the item size. */
static PyObject *raw_array_view(PyObject *a, PyObject *name, const RawView *r, PyObject *dtype,
                                int *misaligned) {
  Py_ssize_t item = r->item;
  if (!r->torch) {
    PyObject *it = PyObject_GetAttr(dtype, s_itemsize);
    item = it ? PyLong_AsSsize_t(it) : -1;
    Py_XDECREF(it);
    if (item == -1 && PyErr_Occurred()) return NULL;
  }
  if (item <= 0) Py_RETURN_NONE;
  Py_ssize_t size = 1, lo = 0, hi = 0;
  for (Py_ssize_t k = 0; k < r->ndim; k++) {
    Py_ssize_t n = r->shape[k], bytes = r->torch ? r->strides[k] * item : r->strides[k];
    if (!r->torch && bytes % item) Py_RETURN_NONE;
    size *= n;
    if (bytes < 0)
      lo += (n - 1) * bytes;
    else
      hi += (n - 1) * bytes;
  }
  if (!r->ptr && size) Py_RETURN_NONE; /* the Python loop names it */
  PyObject *strides = PyTuple_New(r->ndim);
  for (Py_ssize_t k = 0; strides && k < r->ndim; k++) {
    PyObject *x = PyLong_FromSsize_t(r->torch ? r->strides[k] : r->strides[k] / item);
    if (!x) Py_CLEAR(strides);
    else PyTuple_SET_ITEM(strides, k, x);
  }
  if (!strides) return NULL;
  PyObject *v = view_type->tp_alloc(view_type, 0);
  if (!v) {
    Py_DECREF(strides);
    return NULL;
  }
  view_set(v, V_STRIDES, strides);
  view_put(v, V_ARRAY, a);
  view_put(v, V_OWNER, a);
  view_put(v, V_NAME, name);
  view_put(v, V_DTYPE, dtype);
  view_put(v, V_READONLY, Py_False);
  view_put(v, V_LEGACY, Py_False);
  view_put(v, V_HOST, Py_None);
  if (view_set(v, V_DEVICE, raw_device(r)) ||
      view_set(v, V_PTR, PyLong_FromUnsignedLongLong(r->ptr)) ||
      view_set(v, V_SHAPE, ssize_tuple(r->shape, r->ndim)) ||
      view_set(v, V_SIZE, PyLong_FromSsize_t(size)) ||
      view_set(v, V_SPAN, Py_BuildValue("(nn)", lo, hi + item))) {
    Py_DECREF(v);
    return NULL;
  }
  *misaligned = (r->ptr % (uint64_t)item) != 0;
  return v;
}

/* read_views(arrays, names, torch_dtypes, verified) -> (views, kinds, misaligned) as
 * _arrays.read_arguments gives them, or None: the Python loop reads the call. torch_dtypes maps a
 * torch dtype to its NumPy dtype; verified is the set of devices whose torch struct reads agreed
 * with the attributes (a tensor of another device: None). */
static PyObject *read_views(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "read_views(arrays, names, torch_dtypes, verified)");
    return NULL;
  }
  if (!view_type) Py_RETURN_NONE;
  PyObject *arrays = PySequence_Fast(args[0], "arrays must be a sequence");
  if (!arrays) return NULL;
  PyObject *names = PySequence_Fast(args[1], "names must be a sequence");
  if (!names) {
    Py_DECREF(arrays);
    return NULL;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(arrays);
  PyObject *views = NULL, *misaligned = NULL, *result = NULL;
  long kinds = 0;
  if (n > PySequence_Fast_GET_SIZE(names)) goto python; /* the loop names the missing names */
  views = PyList_New(n);
  for (Py_ssize_t i = 0; views && i < n; i++) {
    PyObject *a = PySequence_Fast_GET_ITEM(arrays, i), *v;
    if (a == Py_None) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(views, i, Py_None);
      continue;
    }
    RawView r;
    int readable = raw_view(a, &r);
    if (readable < 0) goto done;
    if (!readable) goto python;
    PyObject *dtype = r.dtype;
    if (r.torch) {
      if (r.device < 0) goto python;
      dtype = PyDict_GetItemWithError(args[2], r.dtype);
      if (!dtype) goto python_or_error;
      PyObject *dev = PyLong_FromLong(r.device);
      int ok = dev ? PySet_Contains(args[3], dev) : -1;
      Py_XDECREF(dev);
      if (ok < 0) goto done;
      if (!ok) goto python;
    }
    int off = 0;
    v = raw_array_view(a, PySequence_Fast_GET_ITEM(names, i), &r, dtype, &off);
    if (!v) goto done;
    PyList_SET_ITEM(views, i, v);
    if (v == Py_None) goto python;
    kinds |= r.torch ? TORCH : CUPY;
    if (off) {
      if (!misaligned && !(misaligned = PyList_New(0))) goto done;
      if (PyList_Append(misaligned, v) < 0) goto done;
    }
  }
  if (views) {
    result = Py_BuildValue("(OlO)", views, kinds, misaligned ? misaligned : Py_None);
  }
  goto done;
python_or_error:
  if (PyErr_Occurred()) goto done;
python:
  result = Py_None;
  Py_INCREF(result);
done:
  Py_DECREF(arrays);
  Py_DECREF(names);
  Py_XDECREF(views);
  Py_XDECREF(misaligned);
  return result;
}

static PyObject *ptr_list(const uint64_t *ptrs, int n) {
  PyObject *list = PyList_New(n);
  if (!list) return NULL;
  for (int i = 0; i < n; i++) {
    PyObject *v = PyLong_FromUnsignedLongLong(ptrs[i]);
    if (!v) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, i, v);
  }
  return list;
}

/* The hook `which` (a function) called with `arg` (NULL: none). */
static PyObject *call_hook(Caller *self, int which, PyObject *arg) {
  PyObject *fn = self->hooks[which];
  return arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
}

/* Raise the error of a failed driver or cuBLAS call: _launch's `raiser` (CuPy's error where CuPy
 * has one), else a RuntimeError "<what> <code>". Returns -1. */
static int call_failed(Caller *self, int raiser, int code, const char *what) {
  PyObject *c = PyLong_FromLong(code);
  PyObject *r = c ? call_hook(self, raiser, c) : NULL;
  Py_XDECREF(c);
  Py_XDECREF(r);
  if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "%s %d", what, code);
  return -1;
}

/* A GEMM step (_launch.Gemm.run, the same three calls) on the calling thread's CuPy cuBLAS handle
 * of the current device (the plan's). */
static int run_gemm(Caller *self, const Step *st, const uint64_t *ptrs, void *stream) {
  PyObject *h = call_hook(self, H_CUBLAS_HANDLE, NULL);
  if (!h) return -1;
  void *handle = PyLong_AsVoidPtr(h);
  Py_DECREF(h);
  if (PyErr_Occurred()) return -1;
  const int *g = st->args;
  const Slot *sl = st->slots;
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = cublas_set_stream(handle, stream);
  if (!status) status = cublas_set_pointer_mode(handle, 0);
  if (!status)
    status = cublas_gemm_ex(handle, 1, 0, g[0], g[1], g[2], &alpha_beta[0],
                            (const void *)(uintptr_t)(ptrs[sl[0].arg] + (uint64_t)sl[0].off), g[6],
                            g[3], (const void *)(uintptr_t)(ptrs[sl[1].arg] + (uint64_t)sl[1].off),
                            g[6], g[4], &alpha_beta[1],
                            (void *)(uintptr_t)(ptrs[sl[2].arg] + (uint64_t)sl[2].off), g[7], g[5],
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  Py_END_ALLOW_THREADS
  return status ? call_failed(self, H_CUBLAS_FAILED, status, "cuBLAS failed with status") : 0;
}

/* The launches of `plan` (its steps) with pointers `ptrs` (arguments, then outputs). */
static int launch_steps(Caller *self, NativePlan *plan, const uint64_t *ptrs, void *stream) {
  _Alignas(16) unsigned char rec[RECORD_MAX];
  for (int s = 0; s < plan->n_steps; s++) {
    Step *st = &plan->steps[s];
    if (st->gemm) {
      if (run_gemm(self, st, ptrs, stream)) return -1;
      continue;
    }
    uint64_t *fields = (uint64_t *)rec;
    for (int k = 0; k < st->n_ptr; k++) {
      Slot sl = st->slots[k];
      fields[k] = (sl.arg < 0 ? 0 : ptrs[sl.arg]) + (uint64_t)sl.off;
    }
    memcpy(rec + 8 * st->n_ptr, st->tail, st->tail_len);
    void *params[1] = {rec};
    int err;
    if (!(st->pdl ? (void *)cu_launch_ex : (void *)cu_launch)) {
      PyErr_SetString(PyExc_RuntimeError, "ropekv's C replay has no driver launch function");
      return -1;
    }
    if (!st->pdl) {
      /* the driver call runs without the GIL (other threads may go on; the record is ours) */
      Py_BEGIN_ALLOW_THREADS
      err = cu_launch(st->func, st->grid[0], st->grid[1], st->grid[2], st->block[0],
                      st->block[1], st->block[2], st->smem, stream, params, NULL);
      Py_END_ALLOW_THREADS
    } else {
      LaunchAttribute attr;
      memset(&attr, 0, sizeof attr);
      attr.id = PROGRAMMATIC_STREAM_SERIALIZATION;
      attr.value[0] = 1;
      LaunchConfig config;
      memset(&config, 0, sizeof config);
      memcpy(config.grid, st->grid, sizeof st->grid);
      memcpy(config.block, st->block, sizeof st->block);
      config.smem = st->smem;
      config.stream = stream;
      config.attrs = &attr;
      config.num_attrs = 1;
      Py_BEGIN_ALLOW_THREADS
      err = cu_launch_ex(&config, st->func, params, NULL);
      Py_END_ALLOW_THREADS
    }
    if (err) return call_failed(self, H_DRIVER_FAILED, err, "cuLaunchKernel failed with CUresult");
  }
  return 0;
}

enum { AS_IS = 0, KEY = 1, FLAG = 2, DTYPE = 3, INT = 4 }; /* _launch's flag kinds */

/* 1 when every scalar argument already is what its normalization would give (Op.normalize), so
 * the call's values are its plan's flags; 0: the Python path normalizes (and raises); -1 error. */
static int flags_are_normal(Caller *self, PyObject *flags) {
  if (self->kinds == Py_None) return 1;
  Py_ssize_t n = PyTuple_GET_SIZE(self->kinds);
  if (!PyTuple_CheckExact(flags) || PyTuple_GET_SIZE(flags) != n) return 0;
  PyObject *np_bool = self->hooks[H_NP_BOOL], *np_dtype = self->hooks[H_NP_DTYPE];
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = PyTuple_GET_ITEM(flags, i);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(self->kinds, i));
    if (kind == -1 && PyErr_Occurred()) return -1;
    if (kind == FLAG) {
      if (v != Py_True && v != Py_False) return 0;
    } else if (kind == INT) {
      if (!PyLong_CheckExact(v) && v != Py_None) return 0;
    } else if (kind == KEY) {
      if (PyBool_Check(v) || PyList_Check(v)) return 0;
      if (!(PyFloat_CheckExact(v) || PyLong_CheckExact(v) || PyUnicode_CheckExact(v) ||
            PyTuple_CheckExact(v) || v == Py_None)) {
        if (Py_IS_TYPE(v, (PyTypeObject *)np_bool)) return 0;
      }
    } else if (kind == DTYPE) {
      if (v == Py_None || PyUnicode_CheckExact(v)) continue;
      if (!PyObject_TypeCheck(v, (PyTypeObject *)np_dtype)) return 0;
    }
  }
  return 1;
}

/* Launch `np`, the NativePlan of `plan`, on the pointers `ptrs` of `arrays` (`n` arguments; room
 * for its outputs' after them; `kinds`: the kinds of array read; `layer`: -1, or the layer whose
 * offsets are added): the stream rule, the capture check, the device, the outputs, the launches.
 * The op's result, the miss (Plan.replay serves the call: a capturing stream of a plan that
 * refuses capture, or no runtime bound yet), or NULL with an error set. */
static PyObject *launch_plan(Caller *self, PyObject *plan, NativePlan *np, PyObject *arrays,
                             uint64_t *ptrs, int n, int kinds, PyObject *stream_arg,
                             long long layer) {
  PyObject *result = NULL, *outs = NULL;
  /* -- the stream rule, the device */
  int explicit_stream = stream_arg != Py_None;
  uint64_t stream;
  PyObject *dev_obj = PyLong_FromLong(np->device);
  if (!dev_obj) goto done;
  if (explicit_stream) {
    if (as_u64_borrowed(stream_arg, &stream)) {
      Py_DECREF(dev_obj);
      goto done;
    }
  } else if (as_u64(call_hook(self, kinds & TORCH ? H_TORCH_STREAM : H_CUPY_STREAM, dev_obj),
                    &stream)) {
    Py_DECREF(dev_obj);
    goto done;
  }
  if (np->no_capture) { /* a capturing stream: Plan.replay refuses it or runs the
                          plan's capture plan */
    PyObject *stream_obj = PyLong_FromUnsignedLongLong(stream);
    PyObject *r = stream_obj ? call_hook(self, H_CAPTURING, stream_obj)
                             : NULL;
    Py_XDECREF(stream_obj);
    int capturing = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    if (capturing) {
      Py_DECREF(dev_obj);
      if (capturing < 0) goto done;
      goto miss;
    }
  }
  PyObject *runtime_box = self->hooks[H_RUNTIME];
  PyObject *runtime = PyList_GET_SIZE(runtime_box)
                          ? PyList_GET_ITEM(runtime_box, 0)
                          : NULL;
  if (!runtime || runtime == Py_None) {
    Py_DECREF(dev_obj);
    if (PyErr_Occurred()) goto done;
    goto miss; /* the runtime is bound by the first launch, in Python */
  }
  Py_INCREF(runtime);
  PyObject *prev_obj = PyObject_CallMethodNoArgs(runtime, s_getDevice);
  long previous = prev_obj ? PyLong_AsLong(prev_obj) : -1;
  Py_XDECREF(prev_obj);
  if (previous == -1 && PyErr_Occurred()) {
    Py_DECREF(runtime);
    Py_DECREF(dev_obj);
    goto done;
  }
  int switched = previous != np->device;
  if (switched) {
    PyObject *r = PyObject_CallMethodOneArg(runtime, s_setDevice, dev_obj);
    if (!r) {
      Py_DECREF(runtime);
      Py_DECREF(dev_obj);
      goto done;
    }
    Py_DECREF(r);
  }
  Py_DECREF(dev_obj);

  /* -- outputs, layer offsets, launches */
  int ok = 0;
  if (np->n_outputs) {
    PyObject *stream_obj = PyLong_FromUnsignedLongLong(stream);
    PyObject *kinds_obj = stream_obj ? PyLong_FromLong(kinds) : NULL;
    PyObject *made = NULL;
    if (kinds_obj) { /* outputs of zero size only (made once per array kind): Plan.empties */
      PyObject *empties = PyObject_GetAttr(plan, s_empties);
      PyObject *e = empties && PyDict_CheckExact(empties)
                        ? PyDict_GetItemWithError(empties, kinds_obj)
                        : NULL;
      if (e && PyTuple_CheckExact(e) && PyTuple_GET_SIZE(e) == 3 &&
          PyTuple_GET_ITEM(e, 2) == Py_True)
        made = PyTuple_Pack(2, PyTuple_GET_ITEM(e, 0), PyTuple_GET_ITEM(e, 1));
      Py_XDECREF(empties);
    }
    if (kinds_obj && !made && !PyErr_Occurred()) {
      PyObject *call_args[] = {plan, kinds_obj, stream_obj,
                               explicit_stream ? Py_True : Py_False};
      made = PyObject_VectorcallMethod(s_make_outputs, call_args, 4, NULL);
    }
    Py_XDECREF(stream_obj);
    Py_XDECREF(kinds_obj);
    if (made && PyTuple_Check(made) && PyTuple_GET_SIZE(made) == 2) {
      PyObject *out_ptrs = PySequence_Fast(PyTuple_GET_ITEM(made, 1), "output pointers");
      if (out_ptrs && PySequence_Fast_GET_SIZE(out_ptrs) == np->n_outputs) {
        ok = 1;
        for (int k = 0; k < np->n_outputs && ok; k++) {
          ok = as_u64_borrowed(PySequence_Fast_GET_ITEM(out_ptrs, k), &ptrs[n + k]) == 0;
        }
      } else if (out_ptrs) {
        PyErr_SetString(PyExc_RuntimeError, "make_outputs gave another count of outputs");
      }
      Py_XDECREF(out_ptrs);
      if (ok) {
        outs = PyTuple_GET_ITEM(made, 0);
        Py_INCREF(outs);
      }
    } else if (made) {
      PyErr_SetString(PyExc_RuntimeError, "make_outputs must give (outputs, pointers)");
    }
    Py_XDECREF(made);
  } else {
    outs = PyTuple_New(0);
    ok = outs != NULL;
  }
  if (ok) {
    for (int k = 0; k < np->n_layered && layer >= 0; k++)
      ptrs[np->layer_arg[k]] += (uint64_t)(layer * np->layer_stride[k]);
    ok = launch_steps(self, np, ptrs, (void *)(uintptr_t)stream) == 0;
  }
  if (switched) { /* back to the caller's device, keeping any error of the launch */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *prev = PyLong_FromLong(previous);
    PyObject *r = prev ? PyObject_CallMethodOneArg(runtime, s_setDevice, prev) : NULL;
    Py_XDECREF(prev);
    Py_XDECREF(r);
    if (exc_type) {
      PyErr_Clear();
      PyErr_Restore(exc_type, exc_value, exc_tb);
    } else if (!r) {
      ok = 0;
    }
  }
  Py_DECREF(runtime);
  if (!ok) goto done;

  /* -- the op's result */
  PyObject *make_result = PyObject_GetAttr(plan, s_result);
  if (!make_result) goto done;
  if (make_result == Py_None) {
    result = make_result;
  } else {
    result = PyObject_CallFunctionObjArgs(make_result, arrays, outs, NULL);
    Py_DECREF(make_result);
  }
  goto done;

miss:
  Py_INCREF(self->miss);
  result = self->miss;
done:
  Py_XDECREF(outs);
  return result;
}

/* Caller(arrays, flags, stream_ptr, layer, plans) -> the op's result, MISS, or _NewLayout(layout)
 * when every argument was read and its layout has no plan. */
static PyObject *caller_call(Caller *self, PyObject *const *args, size_t nargsf,
                             PyObject *kwnames) {
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 5 || kwnames) {
    PyErr_SetString(PyExc_TypeError, "Caller(arrays, flags, stream_ptr, layer, plans)");
    return NULL;
  }
  PyObject *arrays = args[0], *flags = args[1], *stream_arg = args[2], *layer_arg = args[3],
           *plans = args[4];
  if (!PyTuple_CheckExact(arrays) || PyTuple_GET_SIZE(arrays) > MAX_ARGS) {
    Py_INCREF(self->miss);
    return self->miss;
  }
  int normal = flags_are_normal(self, flags);
  if (normal <= 0) {
    if (normal < 0) return NULL;
    Py_INCREF(self->miss);
    return self->miss;
  }
  int n = (int)PyTuple_GET_SIZE(arrays);
  PyObject *types = self->hooks[H_TYPES];
  if (PyList_GET_SIZE(types) != 2) {
    PyErr_SetString(PyExc_RuntimeError, "ropekv._arrays.KNOWN_TYPES must hold two types");
    return NULL;
  }
  PyObject *cupy_cls = PyList_GET_ITEM(types, 0), *torch_cls = PyList_GET_ITEM(types, 1);

  /* -- the newest replay of this op: its flags equal these, its layout is matched while reading */
  PyObject *result = NULL, *plan = NULL, *native = NULL, *layout = NULL;
  PyObject *last = PyObject_GetAttr(plans, s_last), *last_layout = NULL;
  if (!last) return NULL;
  if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 4 &&
      PyTuple_CheckExact(PyTuple_GET_ITEM(last, 2)) &&
      PyTuple_GET_SIZE(PyTuple_GET_ITEM(last, 2)) == n) {
    int same = PyObject_RichCompareBool(flags, PyTuple_GET_ITEM(last, 1), Py_EQ);
    if (same < 0) goto done;
    if (same) last_layout = PyTuple_GET_ITEM(last, 2);
  }

  /* -- intake: every argument's key and pointer; a key equal to the newest replay's is that key */
  uint64_t ptrs[MAX_ARGS + 1];
  int kinds = 0, matching = last_layout != NULL;
  layout = PyTuple_New(n);
  if (!layout) goto done;
  for (int i = 0; i < n; i++) {
    PyObject *a = PyTuple_GET_ITEM(arrays, i), *key, *entry = matching ? PyTuple_GET_ITEM(
                                                                             last_layout, i)
                                                                       : NULL;
    RawView v;
    int read;
    if (a == Py_None) {
      ptrs[i] = 0;
      Py_INCREF(Py_None);
      key = Py_None;
      matching = matching && entry == Py_None;
    } else if ((read = raw_view(a, &v)) != 0) {
      if (read < 0) goto done;
      ptrs[i] = v.ptr;
      kinds |= v.torch ? TORCH : CUPY;
      int same = matching ? raw_key_equals(&v, entry) : 0;
      if (same < 0) goto done;
      if (same) {
        Py_INCREF(entry);
        key = entry;
      } else {
        matching = 0;
        if (!(key = raw_key(&v))) goto done;
      }
    } else {
      key = read_array(a, cupy_cls, torch_cls, &ptrs[i], &kinds);
      if (!key) {
        if (PyErr_Occurred()) goto done;
        goto miss;
      }
      if (matching) {
        int same = PyObject_RichCompareBool(key, entry, Py_EQ);
        if (same < 0) {
          Py_DECREF(key);
          goto done;
        }
        if (same) {
          Py_DECREF(key);
          Py_INCREF(entry);
          key = entry;
        } else {
          matching = 0;
        }
      }
    }
    PyTuple_SET_ITEM(layout, i, key);
  }

  /* -- the plan: the newest replay's when every key matched, else the table's */
  if (matching) {
    plan = PyTuple_GET_ITEM(last, 3);
    Py_INCREF(plan);
  } else {
    Py_hash_t h = PyObject_Hash(flags);
    if (h == -1) { /* an unhashable flag: the Python path takes it */
      PyErr_Clear();
      goto miss;
    }
    PyObject *key = PyTuple_Pack(2, flags, layout);
    if (!key) goto done;
    if (!PyDict_Check(plans)) {
      Py_DECREF(key);
      PyErr_SetString(PyExc_TypeError, "plans must be a dict");
      goto done;
    }
    plan = PyDict_GetItemWithError(plans, key);
    Py_DECREF(key);
    if (!plan) { /* a new layout: Op.__call__ plans it with the key read here (_NewLayout) */
      if (!PyErr_Occurred()) result = call_hook(self, H_NEW_LAYOUT, layout);
      goto done;
    }
    Py_INCREF(plan);
    PyObject *hv = PyLong_FromSsize_t(h);
    PyObject *newest = hv ? PyTuple_Pack(4, hv, flags, layout, plan) : NULL;
    Py_XDECREF(hv);
    if (!newest || PyObject_SetAttr(plans, s_last, newest)) {
      Py_XDECREF(newest);
      goto done;
    }
    Py_DECREF(newest);
  }

  native = PyObject_GetAttr(plan, s_native);
  if (!native) goto done;
  NativePlan *np = Py_IS_TYPE(native, &NativePlanType) ? (NativePlan *)native : NULL;
  long long layer = -1;
  if (layer_arg != Py_None) {
    layer = PyLong_AsLongLong(layer_arg);
    if (layer == -1 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) goto done;
      PyErr_Clear(); /* beyond int64: out of range, which the Python path says (ValueError) */
      goto miss;
    }
    /* the Python path decides a layer out of range (its error), a layer of a plan whose layer
     * strides change the arrays' alignment (perhaps a first call), and any layer of a plan
     * without launches in C */
    if (!np || np->layer_strict || !(layer >= 0 && layer < np->layer_count)) goto miss;
  }
  if (np && np->n_args != n) np = NULL;
  if (np) { /* overlap: any written range that touches another argument's goes to Plan.replay */
    for (int p = 0; p < np->n_pairs; p++) {
      int64_t *q = np->pairs[p];
      int64_t pi = (int64_t)ptrs[q[0]], pj = (int64_t)ptrs[q[1]];
      if (pi + q[2] < pj + q[5] && pj + q[4] < pi + q[3]) {
        np = NULL;
        break;
      }
    }
  }
  if (!np) { /* Plan.replay: the exact overlap check, the layer range, any kind of step */
    PyObject *plist = ptr_list(ptrs, n);
    PyObject *pykinds = plist ? PyLong_FromLong(kinds) : NULL;
    PyObject *layer_obj = layer_arg;
    if (pykinds) {
      PyObject *call_args[] = {plan, arrays, plist, pykinds, stream_arg, self->names, layer_obj};
      result = PyObject_VectorcallMethod(s_replay, call_args,
                                         7, NULL);
    }
    Py_XDECREF(plist);
    Py_XDECREF(pykinds);
    goto done;
  }

  result = launch_plan(self, plan, np, arrays, ptrs, n, kinds, stream_arg, layer);
  goto done;

miss:
  Py_INCREF(self->miss);
  result = self->miss;
done:
  Py_XDECREF(layout);
  Py_DECREF(last);
  Py_XDECREF(plan);
  Py_XDECREF(native);
  return result;
}

/* Caller.launch(plan, arrays, ptrs, kinds, stream_ptr, layer) -> the op's result or MISS: the
 * first launch of a plan Op.first_call just made (its native plan), on the pointers it read and
 * checked (overlap included), with no second read of the arguments. MISS (Plan.replay serves the
 * call): no native plan for this many pointers, a layer out of its range, a capturing stream of a
 * plan that refuses capture, no runtime bound yet. */
static PyObject *caller_launch(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "Caller.launch(plan, arrays, ptrs, kinds, stream_ptr, layer)");
    return NULL;
  }
  PyObject *plan = args[0], *arrays = args[1], *plist = args[2], *stream_arg = args[4],
           *layer_arg = args[5];
  if (!PyList_CheckExact(plist)) {
    PyErr_SetString(PyExc_TypeError, "ptrs must be a list");
    return NULL;
  }
  int kinds = (int)PyLong_AsLong(args[3]);
  if (kinds == -1 && PyErr_Occurred()) return NULL;
  PyObject *native = PyObject_GetAttr(plan, s_native), *result = NULL;
  if (!native) return NULL;
  NativePlan *np = Py_IS_TYPE(native, &NativePlanType) ? (NativePlan *)native : NULL;
  Py_ssize_t n = PyList_GET_SIZE(plist);
  long long layer = -1;
  if (np && layer_arg != Py_None) {
    layer = PyLong_AsLongLong(layer_arg);
    if (layer == -1 && PyErr_Occurred()) goto done;
    if (!(layer >= 0 && layer < np->layer_count)) np = NULL;
  }
  if (!np || np->n_args != n || n > MAX_ARGS) {
    Py_INCREF(self->miss);
    result = self->miss;
    goto done;
  }
  uint64_t ptrs[MAX_ARGS + 1];
  for (Py_ssize_t i = 0; i < n; i++) {
    if (as_u64_borrowed(PyList_GET_ITEM(plist, i), &ptrs[i])) goto done;
  }
  result = launch_plan(self, plan, np, arrays, ptrs, (int)n, kinds, stream_arg, layer);
done:
  Py_DECREF(native);
  return result;
}

static PyMethodDef caller_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))caller_launch, METH_FASTCALL,
     "launch(plan, arrays, ptrs, kinds, stream_ptr, layer) -> the result, or the miss: the "
     "first launch of a new plan on the pointers the first call read and checked"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject CallerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ropekv._native_ext.Caller",
    .tp_basicsize = sizeof(Caller),
    .tp_dealloc = (destructor)caller_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "An op's replay in C: Caller(names, kinds, hooks, miss)"
              "(arrays, flags, stream_ptr, layer, plans).",
    .tp_new = caller_new,
    .tp_methods = caller_methods,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Caller, vectorcall),
};

/* ---- module --------------------------------------------------------------------------------- */

static PyObject *configure(PyObject *mod, PyObject *args) {
  PyObject *launch, *launch_ex;
  if (!PyArg_ParseTuple(args, "OO", &launch, &launch_ex)) return NULL;
  void *l = launch == Py_None ? NULL : PyLong_AsVoidPtr(launch);
  if (PyErr_Occurred()) return NULL;
  void *lx = launch_ex == Py_None ? NULL : PyLong_AsVoidPtr(launch_ex);
  if (PyErr_Occurred()) return NULL;
  cu_launch = (launch_fn)l;
  cu_launch_ex = (launch_ex_fn)lx;
  Py_RETURN_NONE;
}

static PyObject *configure_cublas(PyObject *mod, PyObject *args) {
  PyObject *set_stream, *set_pointer_mode, *gemm_ex;
  if (!PyArg_ParseTuple(args, "OOO", &set_stream, &set_pointer_mode, &gemm_ex)) return NULL;
  void *f[3];
  PyObject *given[3] = {set_stream, set_pointer_mode, gemm_ex};
  for (int k = 0; k < 3; k++) {
    f[k] = PyLong_AsVoidPtr(given[k]);
    if (PyErr_Occurred()) return NULL;
    if (!f[k]) {
      PyErr_SetString(PyExc_ValueError, "configure_cublas needs three function addresses");
      return NULL;
    }
  }
  cublas_set_stream = (cublas_set_stream_fn)f[0];
  cublas_set_pointer_mode = (cublas_set_pointer_mode_fn)f[1];
  cublas_gemm_ex = (cublas_gemm_ex_fn)f[2];
  Py_RETURN_NONE;
}

/* overlap_pairs' and written_layouts' arguments (views, written) as PySequence_Fast objects (new
 * references): 0, or -1 with an error set and nothing held. */
static int views_and_written(PyObject *args, PyObject **views, PyObject **written) {
  PyObject *views_in, *written_in;
  if (!PyArg_ParseTuple(args, "OO", &views_in, &written_in)) return -1;
  *views = PySequence_Fast(views_in, "views must be a sequence");
  if (!*views) return -1;
  *written = PySequence_Fast(written_in, "written must be a sequence");
  if (!*written) {
    Py_CLEAR(*views);
    return -1;
  }
  return 0;
}

/* Their answer where the caller's Python form decides: None, or NULL where an error is set. */
static PyObject *python_decides(void) {
  if (PyErr_Occurred()) return NULL;
  Py_RETURN_NONE;
}

/* The byte span of a view (ArrayView.span, relative to its pointer): 1 with *span a new reference
 * to its span tuple and *lo, *hi its ints; 0 for an empty view (size 0: its span unread, nothing
 * set); -2 where the span is no tuple of two ints within +-2**61 (the caller's Python form
 * decides); -1 with an error set. overlap_pairs and max_span read spans through it. */
static int view_span(PyObject *v, PyObject **span, long long *lo, long long *hi) {
  PyObject *size = PyObject_GetAttr(v, s_size);
  if (!size) return -1;
  int nonempty = PyObject_IsTrue(size);
  Py_DECREF(size);
  if (nonempty <= 0) return nonempty;
  PyObject *t = PyObject_GetAttr(v, s_span);
  if (!t) return -1;
  if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2 ||
      !PyLong_CheckExact(PyTuple_GET_ITEM(t, 0)) || !PyLong_CheckExact(PyTuple_GET_ITEM(t, 1))) {
    Py_DECREF(t);
    return -2;
  }
  const long long limit = (long long)1 << 61;
  int o_lo = 0, o_hi = 0;
  *lo = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(t, 0), &o_lo);
  *hi = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(t, 1), &o_hi);
  if (PyErr_Occurred()) {
    Py_DECREF(t);
    return -1;
  }
  if (o_lo || o_hi || *lo < -limit || *lo > limit || *hi < -limit || *hi > limit) {
    Py_DECREF(t);
    return -2;
  }
  *span = t;
  return 1;
}

/* Whether check_no_overlap compares written array i with argument j (both given, not empty): j is
 * another array, and no written one before i (compared as its own written array). */
static inline int compared(Py_ssize_t i, Py_ssize_t j, const int *given, const int *is_written) {
  return given[j] && j != i && !(j < i && is_written[j]);
}

/* overlap_pairs(views, written) -> (pairs, hits): _checks.check_no_overlap's pairs and the pairs
 * whose byte spans intersect, computed as its Python loop does (the first call of an op with many
 * arguments compares a hundred pairs or so; almost none intersect):
 *
 *   pairs: (i, j, lo_i, hi_i, lo_j, hi_j) of each written array i (in the order of `written`;
 *          given, size not 0) against each argument j given, not empty, j != i, and not a
 *          written j < i (compared as its own written array), in argument order; the spans'
 *          objects are the views' own span items;
 *   hits:  (i, j) of those pairs whose absolute byte ranges intersect, in the same order, for
 *          the caller's exact test.
 *
 * None where a view is not as expected (a span that is no pair of ints, a pointer past 2**62, a
 * written index out of range, more than MAX_ARGS arguments): the caller's Python loop decides. */
static PyObject *overlap_pairs(PyObject *mod, PyObject *args) {
  PyObject *views, *written;
  if (views_and_written(args, &views, &written)) return NULL;
  PyObject *result = NULL, *pairs = NULL, *hits = NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(views), nw = PySequence_Fast_GET_SIZE(written);
  PyObject *lo_obj[MAX_ARGS], *hi_obj[MAX_ARGS]; /* borrowed from the views' span tuples */
  PyObject *spans[MAX_ARGS];                      /* the span tuples, owned */
  PyObject *index_obj[MAX_ARGS];                  /* the arguments' indices, owned */
  Py_ssize_t n_index = 0;
  int64_t first[MAX_ARGS], end[MAX_ARGS];
  int given[MAX_ARGS], is_written[MAX_ARGS];
  if (n > MAX_ARGS) goto fallback;
  for (Py_ssize_t j = 0; j < n; j++) {
    given[j] = 0;
    is_written[j] = 0;
    spans[j] = NULL;
  }
  for (Py_ssize_t k = 0; k < nw; k++) {
    PyObject *w = PySequence_Fast_GET_ITEM(written, k);
    if (!PyLong_CheckExact(w)) goto fallback;
    Py_ssize_t i = PyLong_AsSsize_t(w);
    if (i == -1 && PyErr_Occurred()) goto fail;
    if (i < 0 || i >= n) goto fallback;
    is_written[i] = 1;
  }
  for (Py_ssize_t j = 0; j < n; j++) { /* the arguments given, not empty: their spans */
    PyObject *v = PySequence_Fast_GET_ITEM(views, j);
    if (v == Py_None) continue;
    long long lo, hi;
    int read = view_span(v, &spans[j], &lo, &hi);
    if (read == -1) goto fail;
    if (read == -2) goto fallback;
    if (!read) continue; /* empty */
    PyObject *ptr_obj = PyObject_GetAttr(v, s_ptr);
    if (!ptr_obj) goto fail;
    int ok = PyLong_CheckExact(ptr_obj), overflow = 0;
    long long ptr = ok ? PyLong_AsLongLongAndOverflow(ptr_obj, &overflow) : 0;
    Py_DECREF(ptr_obj);
    if (ptr == -1 && PyErr_Occurred()) goto fail;
    if (!ok || overflow || ptr < 0 || ptr > ((long long)1 << 62)) goto fallback;
    lo_obj[j] = PyTuple_GET_ITEM(spans[j], 0);
    hi_obj[j] = PyTuple_GET_ITEM(spans[j], 1);
    first[j] = ptr + lo;
    end[j] = ptr + hi;
    given[j] = 1;
  }
  for (Py_ssize_t j = 0; j < n; j++) { /* each argument's index as an int, made once */
    index_obj[j] = PyLong_FromSsize_t(j);
    if (!index_obj[j]) goto fail;
    n_index = j + 1;
  }
  /* each pair's tuple built in place (Py_BuildValue parsing its format per pair took twice the
   * time) */
  pairs = PyList_New(0);
  hits = pairs ? PyList_New(0) : NULL;
  if (!hits) goto fail;
  for (Py_ssize_t k = 0; k < nw; k++) {
    Py_ssize_t i = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(written, k));
    if (!given[i]) continue; /* None or empty: never compared */
    for (Py_ssize_t j = 0; j < n; j++) {
      if (!compared(i, j, given, is_written)) continue;
      PyObject *pair = PyTuple_New(6);
      if (!pair) goto fail;
      PyObject *items[6] = {index_obj[i], index_obj[j], lo_obj[i], hi_obj[i], lo_obj[j], hi_obj[j]};
      for (int m = 0; m < 6; m++) {
        Py_INCREF(items[m]);
        PyTuple_SET_ITEM(pair, m, items[m]);
      }
      int appended = PyList_Append(pairs, pair);
      Py_DECREF(pair);
      if (appended < 0) goto fail;
      if (first[i] < end[j] && first[j] < end[i]) {
        PyObject *hit = PyTuple_Pack(2, index_obj[i], index_obj[j]);
        if (!hit) goto fail;
        int bad = PyList_Append(hits, hit);
        Py_DECREF(hit);
        if (bad) goto fail;
      }
    }
  }
  result = PyTuple_Pack(2, pairs, hits);
  goto done;
fallback:
  result = python_decides();
  goto done;
fail:
  result = NULL;
done:
  Py_XDECREF(pairs);
  Py_XDECREF(hits);
  for (Py_ssize_t j = 0; j < n_index; j++) Py_DECREF(index_obj[j]);
  if (n <= MAX_ARGS)
    for (Py_ssize_t j = 0; j < n; j++) Py_XDECREF(spans[j]);
  Py_DECREF(views);
  Py_DECREF(written);
  return result;
}

/* Whether check_write_strides passes a view of this shape and these strides at its first test:
 * the dims of size > 1, innermost first, each with a stride past the reach of the ones inside it
 * (1), or not decided here (0: a dim too large for int64, a test that fails; the Python checker
 * decides; dims and strides past 2**31 too). An empty view passes. */
static int strides_plain(PyObject *shape, PyObject *strides) {
  if (!PyTuple_CheckExact(shape) || !PyTuple_CheckExact(strides)) return 0;
  Py_ssize_t nd = PyTuple_GET_SIZE(shape);
  if (PyTuple_GET_SIZE(strides) != nd) return 0;
  int64_t reach = 0;
  for (Py_ssize_t k = nd - 1; k >= 0; k--) {
    PyObject *n_obj = PyTuple_GET_ITEM(shape, k), *s_obj = PyTuple_GET_ITEM(strides, k);
    if (!PyLong_CheckExact(n_obj) || !PyLong_CheckExact(s_obj)) return 0;
    int overflow = 0;
    long long n = PyLong_AsLongLongAndOverflow(n_obj, &overflow);
    if (overflow || n < 0 || n > ((long long)1 << 31)) return 0;
    if (n == 0) return 1; /* empty */
    if (n == 1) continue;
    long long st = PyLong_AsLongLongAndOverflow(s_obj, &overflow);
    if (overflow || st > ((long long)1 << 31)) return 0;
    if (st <= reach) return 0;
    reach += (n - 1) * st; /* below 2**61 + 2**62: no overflow */
    if (reach > ((long long)1 << 61)) return 0;
  }
  return 1;
}

/* written_layouts(views, written) -> (layouts, ptrs, slow): what a first call records and checks
 * of its arguments besides the overlap pairs (overlap_pairs), in one call:
 *
 *   layouts: (shape, strides, itemsize) of each view (None for None), as Plan.finish records;
 *   ptrs:    each view's pointer (0 for None);
 *   slow:    the written views (in the order of `written`; None skipped) the caller must check in
 *            Python: read-only or legacy ones (check_writable), and those whose strides
 *            strides_plain does not pass (check_write_strides).
 *
 * None where a written index is out of range or a view has more than MAX_ARGS arguments. */
static PyObject *written_layouts(PyObject *mod, PyObject *args) {
  PyObject *views, *written;
  if (views_and_written(args, &views, &written)) return NULL;
  PyObject *result = NULL, *layouts = NULL, *ptrs = NULL, *slow = NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(views), nw = PySequence_Fast_GET_SIZE(written);
  if (n > MAX_ARGS) goto fallback;
  layouts = PyList_New(n);
  ptrs = layouts ? PyList_New(n) : NULL;
  slow = ptrs ? PyList_New(0) : NULL;
  if (!slow) goto fail;
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *v = PySequence_Fast_GET_ITEM(views, j);
    if (v == Py_None) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(layouts, j, Py_None);
      Py_INCREF(zero);
      PyList_SET_ITEM(ptrs, j, zero);
      continue;
    }
    PyObject *ptr = PyObject_GetAttr(v, s_ptr);
    if (!ptr) goto fail;
    PyList_SET_ITEM(ptrs, j, ptr);
    PyObject *shape = PyObject_GetAttr(v, s_shape);
    PyObject *strides = shape ? PyObject_GetAttr(v, s_strides) : NULL;
    PyObject *dtype = strides ? PyObject_GetAttr(v, s_dtype) : NULL;
    PyObject *item = dtype ? PyObject_GetAttr(dtype, s_itemsize) : NULL;
    PyObject *layout = item ? PyTuple_Pack(3, shape, strides, item) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(item);
    if (!layout) goto fail;
    PyList_SET_ITEM(layouts, j, layout);
  }
  for (Py_ssize_t k = 0; k < nw; k++) {
    PyObject *w = PySequence_Fast_GET_ITEM(written, k);
    if (!PyLong_CheckExact(w)) goto fallback;
    Py_ssize_t i = PyLong_AsSsize_t(w);
    if (i == -1 && PyErr_Occurred()) goto fail;
    if (i < 0 || i >= n) goto fallback;
    PyObject *v = PySequence_Fast_GET_ITEM(views, i);
    if (v == Py_None) continue;
    int plain = 1;
    PyObject *flags[2] = {s_readonly, s_legacy};
    for (int f = 0; f < 2 && plain; f++) {
      PyObject *x = PyObject_GetAttr(v, flags[f]);
      if (!x) goto fail;
      int set = PyObject_IsTrue(x);
      Py_DECREF(x);
      if (set < 0) goto fail;
      if (set) plain = 0;
    }
    if (plain) {
      PyObject *layout = PyList_GET_ITEM(layouts, i);
      plain = strides_plain(PyTuple_GET_ITEM(layout, 0), PyTuple_GET_ITEM(layout, 1));
    }
    if (!plain && PyList_Append(slow, w)) goto fail;
  }
  result = PyTuple_Pack(3, layouts, ptrs, slow);
  goto done;
fallback:
  result = python_decides();
  goto done;
fail:
  result = NULL;
done:
  Py_XDECREF(layouts);
  Py_XDECREF(ptrs);
  Py_XDECREF(slow);
  Py_DECREF(views);
  Py_DECREF(written);
  return result;
}

/* same_device(views) -> the device of the first view that is not None when no other view's
 * device differs from it (`!=`, as check_same_device compares), else None: none given, or two
 * devices (check_same_device's loop names them). */
static PyObject *same_device(PyObject *mod, PyObject *views_in) {
  PyObject *views = PySequence_Fast(views_in, "views must be a sequence");
  if (!views) return NULL;
  PyObject *first = NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *v = PySequence_Fast_GET_ITEM(views, j);
    if (v == Py_None) continue;
    PyObject *device = PyObject_GetAttr(v, s_device);
    if (!device) goto fail;
    if (!first) {
      first = device;
      continue;
    }
    int differ = PyObject_RichCompareBool(device, first, Py_NE);
    Py_DECREF(device);
    if (differ < 0) goto fail;
    if (differ) {
      Py_DECREF(first);
      Py_DECREF(views);
      Py_RETURN_NONE;
    }
  }
  Py_DECREF(views);
  if (!first) Py_RETURN_NONE;
  return first;
fail:
  Py_XDECREF(first);
  Py_DECREF(views);
  return NULL;
}

/* max_span(views) -> the widest byte span (hi - lo of ArrayView.span) among the views given (None
 * skipped; 0 for none), -1 where a given view is empty (its span is then no bound of what its
 * strides reach), or None where a span is not a pair of ints within +-2**61 (the Python form,
 * _arrays.max_span, answers). One call for a first call's bound of its 32-bit offsets. */
static PyObject *max_span(PyObject *mod, PyObject *views_in) {
  PyObject *views = PySequence_Fast(views_in, "views must be a sequence");
  if (!views) return NULL;
  long long widest = 0;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *v = PySequence_Fast_GET_ITEM(views, j);
    if (v == Py_None) continue;
    PyObject *span;
    long long lo, hi;
    int read = view_span(v, &span, &lo, &hi);
    if (read == -1) goto fail;
    if (read == -2) {
      Py_DECREF(views);
      Py_RETURN_NONE;
    }
    if (!read) {
      widest = -1;
      break;
    }
    Py_DECREF(span);
    if (hi - lo > widest) widest = hi - lo;
  }
  Py_DECREF(views);
  return PyLong_FromLongLong(widest);
fail:
  Py_DECREF(views);
  return NULL;
}

/* bind_dims(views, program, bound) -> the dims of a first call's arrays, bound by name as an op's
 * declaration spells its shapes (_arrays.bind_dims, whose Python loop is this function's oracle):
 *
 *   program: (n_vars, entries, relations); entries: (slot, dims, dtypes, contig) per array, its
 *            view views[slot], which must be given, of rank len(dims), dim k binding var dims[k]
 *            (the first array to name a var binds it, every later one must agree); dtypes: the
 *            dtypes it may have (empty: any), each a dtype or the slot of the array whose dtype
 *            it may have; contig: 0 none, 1 stride 1 in its last dim (or no elements there),
 *            2 C-contiguous (ArrayView.is_c_contiguous); relations: (v, a, b, k) with var v ==
 *            var a + var b + k (b < 0: no var b), each var bound;
 *   bound:   the values of vars 0, 1, ... bound before the first array (scalars such as
 *            page_size; a negative one binds nothing: None).
 *
 * -> a tuple of the n_vars values (-1: not bound), or None where any rule fails, a view is not
 * one read_views builds or a dim passes 2**40 (the loop decides; the op's checks name the error). */
static int bind_dtype_ok(PyObject *dtype, PyObject *rule, PyObject *views) {
  if (!PyTuple_Check(rule)) return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(rule);
  if (n == 0) return 1;
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject *want = PyTuple_GET_ITEM(rule, k);
    if (PyLong_Check(want)) { /* the dtype of the array in that slot */
      Py_ssize_t ref = PyLong_AsSsize_t(want);
      if (ref < 0 || ref >= PySequence_Fast_GET_SIZE(views)) return -1;
      PyObject *other = PySequence_Fast_GET_ITEM(views, ref);
      if (other == Py_None || !Py_IS_TYPE(other, view_type)) return -1;
      want = *(PyObject **)((char *)other + view_offsets[V_DTYPE]);
      if (!want) return -1;
    }
    if (want == dtype) return 1;
    int eq = PyObject_RichCompareBool(dtype, want, Py_EQ);
    if (eq) return eq; /* 1, or -1 with an error set */
  }
  return 0;
}

#define BIND_MAX_VARS 32
#define BIND_MAX_DIMS 8
#define BIND_MAX_DIM ((long long)1 << 40) /* larger dims are the loop's (no sum overflows) */

static PyObject *bind_dims(PyObject *mod, PyObject *args) {
  PyObject *views_in, *program, *bound, *views = NULL;
  if (!PyArg_ParseTuple(args, "OO!O!", &views_in, &PyTuple_Type, &program, &PyTuple_Type, &bound))
    return NULL;
  if (!view_type || PyTuple_GET_SIZE(program) != 3) Py_RETURN_NONE;
  Py_ssize_t n_vars = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 0));
  PyObject *entries = PyTuple_GET_ITEM(program, 1), *relations = PyTuple_GET_ITEM(program, 2);
  if (n_vars < 0 || n_vars > BIND_MAX_VARS || !PyTuple_Check(entries) || !PyTuple_Check(relations))
    return python_decides();
  Py_ssize_t vars[BIND_MAX_VARS]; /* -1: not bound; a bound one is at most BIND_MAX_DIM */
  for (Py_ssize_t k = 0; k < n_vars; k++) vars[k] = -1;
  if (PyTuple_GET_SIZE(bound) > n_vars) Py_RETURN_NONE;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(bound); k++) {
    long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(bound, k));
    if (PyErr_Occurred() || value < 0 || value > BIND_MAX_DIM) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    vars[k] = value;
  }
  views = PySequence_Fast(views_in, "views must be a sequence");
  if (!views) return NULL;
  Py_ssize_t n_views = PySequence_Fast_GET_SIZE(views);
  for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(entries); e++) {
    PyObject *entry = PyTuple_GET_ITEM(entries, e);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4) goto undecided;
    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
    PyObject *dims = PyTuple_GET_ITEM(entry, 1), *dtypes = PyTuple_GET_ITEM(entry, 2);
    long contig = PyLong_AsLong(PyTuple_GET_ITEM(entry, 3));
    if (PyErr_Occurred() || slot < 0 || slot >= n_views || !PyTuple_Check(dims)) goto undecided;
    PyObject *v = PySequence_Fast_GET_ITEM(views, slot);
    if (v == Py_None || !Py_IS_TYPE(v, view_type)) goto undecided;
    PyObject *shape = *(PyObject **)((char *)v + view_offsets[V_SHAPE]);
    PyObject *strides = *(PyObject **)((char *)v + view_offsets[V_STRIDES]);
    PyObject *dtype = *(PyObject **)((char *)v + view_offsets[V_DTYPE]);
    Py_ssize_t nd = PyTuple_GET_SIZE(dims);
    if (!shape || !strides || !dtype || !PyTuple_Check(shape) || !PyTuple_Check(strides) ||
        PyTuple_GET_SIZE(shape) != nd || PyTuple_GET_SIZE(strides) != nd || nd > BIND_MAX_DIMS)
      goto undecided;
    Py_ssize_t ext[BIND_MAX_DIMS], st[BIND_MAX_DIMS];
    int empty = 0;
    for (Py_ssize_t k = 0; k < nd; k++) {
      ext[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, k));
      st[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, k));
      Py_ssize_t var = PyLong_AsSsize_t(PyTuple_GET_ITEM(dims, k));
      if (PyErr_Occurred() || ext[k] < 0 || ext[k] > BIND_MAX_DIM || var < 0 || var >= n_vars)
        goto undecided;
      if (vars[var] < 0)
        vars[var] = ext[k];
      else if (vars[var] != ext[k])
        goto undecided;
      if (!ext[k]) empty = 1;
    }
    int ok = bind_dtype_ok(dtype, dtypes, views);
    if (ok != 1) goto undecided;
    if (contig == 1 && nd && !empty && ext[nd - 1] > 1 && st[nd - 1] != 1) goto undecided;
    if (contig == 2 && !empty) {
      Py_ssize_t expected = 1;
      for (Py_ssize_t k = nd - 1; k >= 0; k--) {
        if (ext[k] != 1 && st[k] != expected) goto undecided;
        if (ext[k] > 1 && expected > ((Py_ssize_t)1 << 62) / ext[k]) goto undecided; /* loop's */
        expected *= ext[k];
      }
    }
  }
  for (Py_ssize_t r = 0; r < PyTuple_GET_SIZE(relations); r++) {
    PyObject *rel = PyTuple_GET_ITEM(relations, r);
    if (!PyTuple_Check(rel) || PyTuple_GET_SIZE(rel) != 4) goto undecided;
    Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(rel, 0));
    Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(rel, 1));
    Py_ssize_t b = PyLong_AsSsize_t(PyTuple_GET_ITEM(rel, 2));
    long long k = PyLong_AsLongLong(PyTuple_GET_ITEM(rel, 3));
    if (PyErr_Occurred() || v < 0 || v >= n_vars || a < 0 || a >= n_vars || b >= n_vars)
      goto undecided;
    if (vars[v] < 0 || vars[a] < 0 || (b >= 0 && vars[b] < 0)) goto undecided;
    if (vars[v] != vars[a] + (b >= 0 ? vars[b] : 0) + k) goto undecided;
  }
  Py_DECREF(views);
  return ssize_tuple(vars, n_vars);
undecided:
  Py_DECREF(views);
  PyErr_Clear();
  Py_RETURN_NONE;
}

/* gather_strides(views, program) -> the strides a parameter record takes from a first call's
 * views (_arrays.gather_strides, whose Python loop is this function's oracle): program is a tuple
 * of (slot, axis) pairs, each the stride of views[slot] along axis, or 0 where slot is negative
 * or views[slot] is None. -> a tuple of those strides (the views' own ints), or None where a view
 * is not one read_views builds or lacks the axis (the loop decides, or raises). */
static PyObject *gather_strides(PyObject *mod, PyObject *args) {
  PyObject *views_in, *program, *views, *out;
  if (!PyArg_ParseTuple(args, "OO!", &views_in, &PyTuple_Type, &program)) return NULL;
  if (!view_type) Py_RETURN_NONE;
  views = PySequence_Fast(views_in, "views must be a sequence");
  if (!views) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(program), n_views = PySequence_Fast_GET_SIZE(views);
  out = PyTuple_New(n);
  if (!out) goto failed;
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject *pair = PyTuple_GET_ITEM(program, k), *value = NULL;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) goto undecided;
    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
    Py_ssize_t axis = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
    if (PyErr_Occurred() || slot >= n_views) goto undecided;
    PyObject *v = slot < 0 ? Py_None : PySequence_Fast_GET_ITEM(views, slot);
    if (v != Py_None) {
      if (!Py_IS_TYPE(v, view_type)) goto undecided;
      PyObject *strides = *(PyObject **)((char *)v + view_offsets[V_STRIDES]);
      if (!strides || !PyTuple_Check(strides) || axis < 0 || axis >= PyTuple_GET_SIZE(strides))
        goto undecided;
      value = PyTuple_GET_ITEM(strides, axis);
      if (!PyLong_CheckExact(value)) goto undecided;
    } else {
      value = zero;
    }
    Py_INCREF(value);
    PyTuple_SET_ITEM(out, k, value);
  }
  Py_DECREF(views);
  return out;
undecided:
  Py_DECREF(out);
  Py_DECREF(views);
  PyErr_Clear();
  Py_RETURN_NONE;
failed:
  Py_DECREF(views);
  return NULL;
}

/* widest_aligned(views) -> _vector.widest_aligned's value: 16, or the least over the views of
 * the lowest set bit (below 16 bytes) of the pointer or'ed with the strides but the last times
 * the itemsize, in elements. The gcd of the strides has the lowest set bit of their bitwise or,
 * so the or of their magnitudes stands for it; the low four bits of a product are exact modulo
 * 2**64. None for anything the loop must see (a non-int pointer or stride, a stride outside
 * int64, an itemsize not positive, a view that is not one): the Python loop answers or raises. */
static PyObject *widest_aligned(PyObject *mod, PyObject *views_in) {
  PyObject *views = PySequence_Fast(views_in, "views must be a sequence");
  if (!views) return NULL;
  long long widest = 16;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(views);
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *v = PySequence_Fast_GET_ITEM(views, j);
    PyObject *ptr = PyObject_GetAttr(v, s_ptr);
    if (!ptr) goto undecided;
    PyObject *strides = PyObject_GetAttr(v, s_strides);
    if (!strides) {
      Py_DECREF(ptr);
      goto undecided;
    }
    PyObject *dtype = PyObject_GetAttr(v, s_dtype);
    PyObject *item_o = dtype ? PyObject_GetAttr(dtype, s_itemsize) : NULL;
    Py_XDECREF(dtype);
    int ok = item_o && PyLong_CheckExact(ptr) && PyTuple_CheckExact(strides) &&
             PyLong_CheckExact(item_o);
    long long item = ok ? PyLong_AsLongLong(item_o) : 0;
    unsigned long long bits = 0, acc = 0;
    if (ok && item > 0) {
      bits = PyLong_AsUnsignedLongLongMask(ptr);
      Py_ssize_t dims = PyTuple_GET_SIZE(strides);
      for (Py_ssize_t d = 0; d + 1 < dims && ok; d++) {
        PyObject *s = PyTuple_GET_ITEM(strides, d);
        long long x = PyLong_CheckExact(s) ? PyLong_AsLongLong(s) : (ok = 0, 0);
        if (x == -1 && PyErr_Occurred()) ok = 0;
        acc |= x < 0 ? 0ULL - (unsigned long long)x : (unsigned long long)x;
      }
    } else {
      ok = 0;
    }
    if (PyErr_Occurred()) ok = 0;
    Py_XDECREF(item_o);
    Py_DECREF(ptr);
    Py_DECREF(strides);
    if (!ok) goto undecided;
    bits = (bits | acc * (unsigned long long)item) & 15;
    if (bits) {
      long long w = (long long)(bits & (0ULL - bits)) / item;
      if (w < widest) widest = w;
    }
  }
  Py_DECREF(views);
  return PyLong_FromLongLong(widest);
undecided:
  PyErr_Clear();
  Py_DECREF(views);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(cuLaunchKernel address, cuLaunchKernelEx address or None)"},
    {"configure_cublas", configure_cublas, METH_VARARGS,
     "configure_cublas(cublasSetStream_v2, cublasSetPointerMode_v2, cublasGemmEx addresses): "
     "plans may then have GEMM steps"},
    {"configure_cupy", configure_cupy, METH_VARARGS,
     "configure_cupy(ndarray type, MemoryPointer type, shape, strides, dtype, data, ptr offsets) "
     "or configure_cupy(None): read CuPy arrays from their struct, or not"},
    {"configure_torch", configure_torch, METH_VARARGS,
     "configure_torch(Tensor type, offsets, key set, device type, dtypes) or "
     "configure_torch(None): read torch tensors from their TensorImpl, or not"},
    {"view_fields", view_fields, METH_O,
     "view_fields(a) -> (ptr, shape, element strides, dtype, device, size, lo, hi) of a CuPy "
     "array or torch tensor read from its struct, or None"},
    {"configure_views", configure_views, METH_O,
     "configure_views(ArrayView): read_views may build its instances (their slots' offsets)"},
    {"read_views", (PyCFunction)(void (*)(void))read_views, METH_FASTCALL,
     "read_views(arrays, names, torch_dtypes, verified) -> (views, kinds, misaligned) of a "
     "first call's arrays, or None (the Python loop reads them)"},
    {"raw_layout", raw_layout, METH_VARARGS,
     "raw_layout(a, staged=False) -> (shape, strides, dtype, ptr, device) read from a CuPy "
     "array's or a torch tensor's struct, or None (staged: with torch reads not yet enabled)"},
    {"configure_exchange", configure_exchange, METH_VARARGS,
     "configure_exchange(Tensor type, exchange API capsule, DLPack device type, ((code, bits, "
     "dtype, itemsize), ...)) or configure_exchange(None): read torch tensors through torch's "
     "DLPack C exchange API, or not"},
    {"dl_read", dl_read, METH_O,
     "dl_read(t) -> (data, device type, device id, (code, bits, lanes), shape, strides, "
     "byte offset) through the configured exchange API, or None"},
    {"overlap_pairs", overlap_pairs, METH_VARARGS,
     "overlap_pairs(views, written) -> (pairs, hits): check_no_overlap's pairs and those whose "
     "byte ranges intersect, or None (the Python loop decides)"},
    {"written_layouts", written_layouts, METH_VARARGS,
     "written_layouts(views, written) -> (layouts, ptrs, slow): the views' (shape, strides, "
     "itemsize) and pointers, and the written ones to check in Python, or None"},
    {"same_device", same_device, METH_O,
     "same_device(views) -> the one device of the views given, or None (none, or two)"},
    {"max_span", max_span, METH_O,
     "max_span(views) -> the widest byte span of the views given, -1 where one is empty, or None "
     "(the Python form answers)"},
    {"bind_dims", bind_dims, METH_VARARGS,
     "bind_dims(views, program, bound) -> the dims the program's arrays bind, or None (the op's "
     "checks decide)"},
    {"gather_strides", gather_strides, METH_VARARGS,
     "gather_strides(views, program) -> the strides program names, or None (the Python loop "
     "answers)"},
    {"widest_aligned", widest_aligned, METH_O,
     "widest_aligned(views) -> _vector.widest_aligned's value, or None (the Python loop "
     "answers)"},
    {"enable_torch", enable_torch, METH_NOARGS,
     "enable_torch(): the torch reads configure_torch staged go live (once verified)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native_ext",
                                       "ropekv's plan replay in C (see ropekv/_native.c)", -1,
                                       methods};

#define INTERN(var, text)                                   \
  do {                                                      \
    if (!((var) = PyUnicode_InternFromString(text))) return NULL; \
  } while (0)

PyMODINIT_FUNC PyInit__native_ext(void) {
  INTERN(s_data, "data");
  INTERN(s_ptr, "ptr");
  INTERN(s_shape, "shape");
  INTERN(s_strides, "strides");
  INTERN(s_dtype, "dtype");
  INTERN(s_device_id, "device_id");
  INTERN(s_data_ptr, "data_ptr");
  INTERN(s_stride, "stride");
  INTERN(s_get_device, "get_device");
  INTERN(s_last, "last");
  INTERN(s_native, "native");
  INTERN(s_replay, "replay");
  INTERN(s_make_outputs, "make_outputs");
  INTERN(s_result, "result");
  INTERN(s_getDevice, "getDevice");
  INTERN(s_setDevice, "setDevice");
  INTERN(s_empties, "empties");
  INTERN(s_is_neg, "is_neg");
  INTERN(s_itemsize, "itemsize");
  INTERN(s_is_cuda, "is_cuda");
  INTERN(s_size, "size");
  INTERN(s_span, "span");
  INTERN(s_readonly, "readonly");
  INTERN(s_legacy, "legacy");
  INTERN(s_device, "device");
  if (!(one = PyLong_FromLong(1))) return NULL;
  if (!(zero = PyLong_FromLong(0))) return NULL;
  if (PyType_Ready(&NativePlanType) < 0 || PyType_Ready(&CallerType) < 0) return NULL;
  PyObject *m = PyModule_Create(&moduledef);
  if (!m) return NULL;
#ifdef Py_GIL_DISABLED
  /* This module needs the GIL: its configuration (the struct offsets, the driver entry points) is
   * process-global state that configure_* rewrites, and the replay takes borrowed references from
   * dicts other threads may change. Declared so (Py_MOD_GIL_USED), a free-threaded interpreter
   * would enable the GIL on import; ropekv._launch does not load it there (the Python replay
   * serves every call instead). */
  if (PyUnstable_Module_SetGIL(m, Py_MOD_GIL_USED) < 0) {
    Py_DECREF(m);
    return NULL;
  }
#endif
  Py_INCREF(&NativePlanType);
  Py_INCREF(&CallerType);
  if (PyModule_AddObject(m, "NativePlan", (PyObject *)&NativePlanType) ||
      PyModule_AddObject(m, "Caller", (PyObject *)&CallerType)) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
