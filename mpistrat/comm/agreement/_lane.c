/* The compiled lane of a repeated small all-reduce: copy in, the check's shared-memory round, the sums.
 *
 * One call does what ShmAllgather.exchange (the round), AgreementGuard.check_aux (the common verdict)
 * and SmallShmTransport.allreduce_prepared (the copy into this rank's slot and the sums of every
 * rank's slot in local-rank order) do in Python, with the same memory protocol, so ranks that run
 * this and ranks that run the Python path meet in the same round. It sums only after every rank
 * posted the round with this rank's fingerprint and aux and no deadline has passed; anything else
 * goes back to the Python path (mpistrat/comm/agreement/lane.py), which judges and waits as always.
 *
 * run(table, mine, round, lines, h, aux, deadline, spins, src, slot, slots, dst, kind, capacity)
 *   table:    address of the check's int64 table (ShmAllgather's)
 *   mine:     item index of this rank's line for this round's parity (round word; h, aux, deadline after)
 *   lines:    bytes, int64 item index of every rank's line for this parity, in rank order
 *   src, dst: C-contiguous buffers of the call's bytes (dst writable, aliasing no slot); this rank's
 *             term of the sums is read from src where src and dst do not overlap and the GIL was held
 *             from the copy to the sums
 *   slot:     address of this rank's slot; slots: bytes, uint64 address of every rank's slot, rank order
 *   kind:     KIND_* below (dtype and op); capacity: the bytes a slot holds
 * returns True (summed into dst), None (posted; a rank had not posted within ``spins`` polls and then
 * YIELD_NS of yields) or False
 * (every rank posted, but the verdict is not the common one: the caller reads the lines and judges).
 * Every error is raised before the round is posted; after it, nothing can fail.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <sched.h>
#include <time.h>

/* The float sums must be NumPy's bits: IEEE adds in the declared precision, nothing reassociated. */
#if defined(__FAST_MATH__) || (defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0)
#error "the compiled lane needs IEEE float adds (no -ffast-math, FLT_EVAL_METHOD 0): built without it"
#endif

enum { KIND_SUM_F32, KIND_SUM_F64, KIND_SUM_I32, KIND_SUM_I64, KIND_MIN_I32, KIND_MIN_I64, KIND_MAX_I32,
       KIND_MAX_I64, KIND_COUNT };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#define YIELD_NS 1000000 /* 1 ms: the guard's waiter ticks (queries, exit notices) every millisecond */

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t now_ms(void) { /* int(time.time() * 1000), computed as Python does: the guard's clock */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double seconds = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    return (int64_t)(seconds * 1000.0);
}

/* The sums in local-rank order, ((s0 + s1) + s2) + ..., each element as NumPy's ufunc computes it
 * (IEEE adds for floats; integers wrap, done unsigned). Rank ``me``'s term is read from ``own``, the
 * bytes it copied into its slot, unless ``me`` is -1. */
#define TERM(T, j) ((j) == me ? (const T *)own : (const T *)(uintptr_t)slots[j])
#define REDUCE(T, COMBINE)                                                                           \
    do {                                                                                             \
        T *restrict d = (T *)dst; /* a private result: it aliases no slot or own, so loops vectorize */\
        const T *a = TERM(T, 0), *b = TERM(T, 1);                                                    \
        for (Py_ssize_t k = 0; k < count; k++) { T x = a[k], y = b[k]; d[k] = COMBINE; }            \
        for (Py_ssize_t j = 2; j < n; j++) {                                                         \
            const T *s = TERM(T, j);                                                                 \
            for (Py_ssize_t k = 0; k < count; k++) { T x = d[k], y = s[k]; d[k] = COMBINE; }        \
        }                                                                                            \
    } while (0)
#define ADD_WRAP(T, U) (T)((U)x + (U)y)

static void reduce(int kind, void *dst, const uint64_t *slots, Py_ssize_t n, Py_ssize_t nbytes, Py_ssize_t me,
                   const void *own) {
    Py_ssize_t count;
    switch (kind) {
    case KIND_SUM_F32: count = nbytes / 4; REDUCE(float, x + y); break;
    case KIND_SUM_F64: count = nbytes / 8; REDUCE(double, x + y); break;
    case KIND_SUM_I32: count = nbytes / 4; REDUCE(int32_t, ADD_WRAP(int32_t, uint32_t)); break;
    case KIND_SUM_I64: count = nbytes / 8; REDUCE(int64_t, ADD_WRAP(int64_t, uint64_t)); break;
    case KIND_MIN_I32: count = nbytes / 4; REDUCE(int32_t, y < x ? y : x); break;
    case KIND_MIN_I64: count = nbytes / 8; REDUCE(int64_t, y < x ? y : x); break;
    case KIND_MAX_I32: count = nbytes / 4; REDUCE(int32_t, y > x ? y : x); break;
    case KIND_MAX_I64: count = nbytes / 8; REDUCE(int64_t, y > x ? y : x); break;
    }
}

static PyObject *lane_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "_lane.run takes 14 arguments");
        return NULL;
    }
    volatile int64_t *table = (volatile int64_t *)PyLong_AsVoidPtr(args[0]);
    Py_ssize_t mine = PyLong_AsSsize_t(args[1]);
    int64_t round = PyLong_AsLongLong(args[2]);
    int64_t h = PyLong_AsLongLong(args[4]), aux = PyLong_AsLongLong(args[5]), deadline = PyLong_AsLongLong(args[6]);
    long spins = PyLong_AsLong(args[7]);
    char *slot = (char *)PyLong_AsVoidPtr(args[9]);
    long kind = PyLong_AsLong(args[12]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[13]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[3]) || !PyBytes_Check(args[10]) || kind < 0 || kind >= KIND_COUNT) {
        PyErr_SetString(PyExc_TypeError, "_lane.run: lines and slots are bytes, kind a KIND_* value");
        return NULL;
    }
    const int64_t *lines = (const int64_t *)PyBytes_AS_STRING(args[3]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[3]) / 8;
    const uint64_t *slots = (const uint64_t *)PyBytes_AS_STRING(args[10]);
    if (n < 2 || PyBytes_GET_SIZE(args[10]) / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "_lane.run: lines and slots name the same two or more ranks");
        return NULL;
    }
    /* Every argument is checked before the round is posted: an error here leaves the peers' round alone. */
    Py_buffer src, dst;
    if (PyObject_GetBuffer(args[8], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[11], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len != dst.len || src.len > capacity) {
        PyErr_SetString(PyExc_ValueError, "_lane.run: src and dst differ in size, or do not fit a slot");
        goto done;
    }
    memcpy(slot, src.buf, (size_t)src.len);
    table[mine + 1] = h;
    table[mine + 2] = aux;
    table[mine + 3] = deadline;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the slot and the values before the round number */
    table[mine] = round;
    Py_ssize_t r = 0;
    for (; r < n; r++) { /* the spin: a peer about to arrive costs nothing more */
        while (table[lines[r]] != round && spins > 0) {
            spins--;
            cpu_relax();
        }
        if (table[lines[r]] != round)
            break;
    }
    int held = 1; /* the GIL, from the copy to the sums: no Python thread can have written src since */
    if (r < n) {
        held = 0;
        /* Then yield the core for up to YIELD_NS, as the guard's waiter would next (a peer that shares
         * this core runs meanwhile); the GIL is released as os.sched_yield releases it. Past that, the
         * guard waits with its timeouts, stall reports and queries. */
        int arrived = 0;
        Py_BEGIN_ALLOW_THREADS
        int64_t until = mono_ns() + YIELD_NS;
        for (;;) {
            while (r < n && table[lines[r]] == round)
                r++;
            if (r == n) {
                arrived = 1;
                break;
            }
            if (mono_ns() > until)
                break;
            sched_yield();
        }
        Py_END_ALLOW_THREADS
        if (!arrived) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the round numbers before the values and the slots */
    int64_t now = now_ms();
    int common = now <= deadline;
    for (Py_ssize_t i = 0; i < n && common; i++) {
        Py_ssize_t at = lines[i];
        common = table[at + 1] == h && table[at + 2] == aux && table[at + 3] >= now;
    }
    if (common) {
        /* Read this rank's term from src, not from its slot (measured cheaper, benchmarks/README.md), where
         * it holds the bytes the peers read: the GIL was held since the copy (another Python thread
         * could have written src while it was released), and src does not overlap dst (in place, the sums
         * overwrite dst before a later term is read). The same bytes, so the same bits on every rank. */
        Py_ssize_t me = -1;
        uintptr_t s0 = (uintptr_t)src.buf, d0 = (uintptr_t)dst.buf;
        if (held && (s0 + (uintptr_t)src.len <= d0 || d0 + (uintptr_t)dst.len <= s0))
            for (Py_ssize_t i = 0; i < n; i++)
                if (slots[i] == (uint64_t)(uintptr_t)slot)
                    me = i;
        reduce((int)kind, dst.buf, slots, n, dst.len, me, src.buf);
    }
    result = common ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef lane_methods[] = {
    {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
     "Copy in, post the check's round, spin, judge and sum: True (summed), None (a peer late) or False."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lane_module = {
    PyModuleDef_HEAD_INIT, "_lane", "The compiled lane of a repeated small all-reduce.", -1, lane_methods,
};

PyMODINIT_FUNC PyInit__lane(void) {
    PyObject *m = PyModule_Create(&lane_module);
    if (m == NULL)
        return NULL;
    const char *names[KIND_COUNT] = {"KIND_SUM_F32", "KIND_SUM_F64", "KIND_SUM_I32", "KIND_SUM_I64",
                                     "KIND_MIN_I32", "KIND_MIN_I64", "KIND_MAX_I32", "KIND_MAX_I64"};
    for (int k = 0; k < KIND_COUNT; k++)
        if (PyModule_AddIntConstant(m, names[k], k) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
