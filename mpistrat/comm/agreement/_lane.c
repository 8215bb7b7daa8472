/* The compiled lane of a one-array all-reduce on one node, the check's shared-memory round included (or, for
 * scatter, done before it).
 *
 * run (shm-small's call, below) and scatter (the shm window's reduce-scatter, further down). run does what ShmAllgather.exchange (the round), AgreementGuard.check_aux (the common verdict)
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
 *             term of the sums is read from src where src and dst do not overlap, src is aligned to its
 *             items and the GIL was held from the copy to the sums
 *   slot:     address of this rank's slot; slots: bytes, uint64 address of every rank's slot, rank order
 *   kind:     KIND_* below (dtype and op); capacity: the bytes a slot holds
 * returns True (summed into dst), None (posted; a rank had not posted within ``spins`` polls and then
 * YIELD_NS of yields) or False
 * (every rank posted, but the verdict is not the common one: the caller reads the lines and judges).
 * Every error is raised before the round is posted; after it, nothing can fail (both kernels).
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

/* The sums in local-rank order, ((t0 + t1) + t2) + ..., each element as NumPy's ufunc computes it
 * (IEEE adds for floats; integers wrap, done unsigned), of the ``n`` terms ``terms`` into ``dst``. From
 * three terms on, TILE items at a time are summed in ``acc`` (in L1) and stored once: each item's adds in the
 * same order as a pass per term over ``dst``, without reading and writing ``dst`` n - 1 times. */
#define TILE 256
#define REDUCE(T, COMBINE)                                                                           \
    do {                                                                                             \
        T *restrict d = (T *)dst; /* a private result: it aliases no term, so loops vectorize */     \
        if (n == 2) {                                                                                \
            const T *a = (const T *)terms[0], *b = (const T *)terms[1];                              \
            for (Py_ssize_t k = 0; k < count; k++) { T x = a[k], y = b[k]; d[k] = COMBINE; }        \
            break;                                                                                   \
        }                                                                                            \
        T acc[TILE];                                                                                 \
        for (Py_ssize_t k0 = 0; k0 < count; k0 += TILE) {                                            \
            Py_ssize_t m = count - k0 < TILE ? count - k0 : TILE;                                    \
            const T *a = (const T *)terms[0] + k0, *b = (const T *)terms[1] + k0;                    \
            for (Py_ssize_t k = 0; k < m; k++) { T x = a[k], y = b[k]; acc[k] = COMBINE; }          \
            for (Py_ssize_t j = 2; j < n - 1; j++) {                                                 \
                const T *s = (const T *)terms[j] + k0;                                               \
                for (Py_ssize_t k = 0; k < m; k++) { T x = acc[k], y = s[k]; acc[k] = COMBINE; }    \
            }                                                                                        \
            const T *s = (const T *)terms[n - 1] + k0;                                               \
            for (Py_ssize_t k = 0; k < m; k++) { T x = acc[k], y = s[k]; d[k0 + k] = COMBINE; }     \
        }                                                                                            \
    } while (0)
#define ADD_WRAP(T, U) (T)((U)x + (U)y)

static Py_ssize_t kind_size(int kind) { /* the item size of a KIND_* */
    return kind == KIND_SUM_F32 || kind == KIND_SUM_I32 || kind == KIND_MIN_I32 || kind == KIND_MAX_I32 ? 4 : 8;
}

static void reduce(int kind, void *dst, const char *const *terms, Py_ssize_t n, Py_ssize_t nbytes) {
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

/* Wait until every rank's word ``words[r]`` reaches ``value`` (``at_least``: or passes it): ``spins``
 * polls, then yields of the core for up to YIELD_NS with the GIL released (a peer sharing this core
 * runs meanwhile; os.sched_yield releases it too). 1: all arrived with the GIL held throughout; 2: all
 * arrived while it was released; 0: a rank had not (the caller's Python path waits on, with its timeouts,
 * stall reports and queries). */
static int wait_all(volatile int64_t *base, const int64_t *words, Py_ssize_t n, int64_t value, int at_least,
                    long spins) {
#define ARRIVED(r) (at_least ? base[words[r]] >= value : base[words[r]] == value)
    Py_ssize_t r = 0;
    for (; r < n; r++) { /* the spin: a peer about to arrive costs nothing more */
        while (!ARRIVED(r) && spins > 0) {
            spins--;
            cpu_relax();
        }
        if (!ARRIVED(r))
            break;
    }
    if (r == n)
        return 1;
    int arrived = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t until = mono_ns() + YIELD_NS;
    for (;;) {
        while (r < n && ARRIVED(r))
            r++;
        if (r == n) {
            arrived = 2;
            break;
        }
        if (mono_ns() > until)
            break;
        sched_yield();
    }
    Py_END_ALLOW_THREADS
    return arrived;
#undef ARRIVED
}

/* The check's round of one call: the first eight arguments of both kernels (table, mine, round, lines, h,
 * aux, deadline, spins; see run), and the number of ranks ``lines`` names. */
typedef struct {
    volatile int64_t *table;
    Py_ssize_t mine, n;
    int64_t round, h, aux, deadline;
    long spins;
    const int64_t *lines;
} Round;

/* Read a kernel's first eight arguments into ``r``; -1 with an exception set. */
static int parse_round(PyObject *const *args, const char *kernel, Round *r) {
    r->table = (volatile int64_t *)PyLong_AsVoidPtr(args[0]);
    r->mine = PyLong_AsSsize_t(args[1]);
    r->round = PyLong_AsLongLong(args[2]);
    r->h = PyLong_AsLongLong(args[4]);
    r->aux = PyLong_AsLongLong(args[5]);
    r->deadline = PyLong_AsLongLong(args[6]);
    r->spins = PyLong_AsLong(args[7]);
    if (PyErr_Occurred())
        return -1;
    if (!PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) / 8 < 2) {
        PyErr_Format(PyExc_TypeError, "_lane.%s: lines are bytes naming two or more ranks", kernel);
        return -1;
    }
    r->lines = (const int64_t *)PyBytes_AS_STRING(args[3]);
    r->n = PyBytes_GET_SIZE(args[3]) / 8;
    return 0;
}

/* Post this rank's round (``h``, ``aux``, ``deadline``, then the round number, after a fence) and wait
 * for every rank's (wait_all's result); after it returns nonzero, ``*common`` says whether every rank
 * posted this rank's ``h`` and ``aux`` with no deadline passed. */
static int post_round(const Round *r, int *common) {
    volatile int64_t *table = r->table;
    table[r->mine + 1] = r->h;
    table[r->mine + 2] = r->aux;
    table[r->mine + 3] = r->deadline;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the data and the values before the round number */
    table[r->mine] = r->round;
    int arrived = wait_all(table, r->lines, r->n, r->round, 0, r->spins);
    if (!arrived)
        return 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the round numbers before the values and the data */
    int64_t now = now_ms();
    int same = now <= r->deadline;
    for (Py_ssize_t i = 0; i < r->n && same; i++) {
        Py_ssize_t at = r->lines[i];
        same = table[at + 1] == r->h && table[at + 2] == r->aux && table[at + 3] >= now;
    }
    *common = same;
    return arrived;
}

static PyObject *lane_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "_lane.run takes 14 arguments");
        return NULL;
    }
    Round check;
    if (parse_round(args, "run", &check) < 0)
        return NULL;
    char *slot = (char *)PyLong_AsVoidPtr(args[9]);
    long kind = PyLong_AsLong(args[12]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[13]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(args[10]) || kind < 0 || kind >= KIND_COUNT) {
        PyErr_SetString(PyExc_TypeError, "_lane.run: slots are bytes, kind a KIND_* value");
        return NULL;
    }
    Py_ssize_t n = check.n;
    const uint64_t *slots = (const uint64_t *)PyBytes_AS_STRING(args[10]);
    if (PyBytes_GET_SIZE(args[10]) / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "_lane.run: lines and slots name the same ranks");
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
    int common = 0;
    int arrived = post_round(&check, &common);
    if (!arrived) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if (common) {
        /* Read this rank's term from src, not from its slot (measured cheaper, benchmarks/README.md), where
         * it holds the bytes the peers read: the GIL was held since the copy (another Python thread
         * could have written src while it was released), and src does not overlap dst (in place, the sums
         * overwrite dst before a later term is read). The same bytes, so the same bits on every rank. */
        const char *terms[n];
        uintptr_t s0 = (uintptr_t)src.buf, d0 = (uintptr_t)dst.buf;
        int own = arrived == 1 && (s0 + (uintptr_t)src.len <= d0 || d0 + (uintptr_t)dst.len <= s0)
                  && s0 % (uintptr_t)kind_size((int)kind) == 0; /* and it is read as the dtype's items */
        for (Py_ssize_t i = 0; i < n; i++)
            terms[i] = own && slots[i] == (uint64_t)(uintptr_t)slot ? (const char *)src.buf
                                                                     : (const char *)(uintptr_t)slots[i];
        reduce((int)kind, dst.buf, terms, n, dst.len);
    }
    result = common ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* The reduce-scatter of one array on one node, chunk by chunk, its first synchronisation the check's round
 * (or an epoch, where the check was done before: table 0).
 *
 * scatter(table, mine, round, lines, h, aux, deadline, spins, src, dst, kind, segs, itemsize, chunk, direct,
 *         me, controls, blocks, offer, counters, words, epoch, decision)
 *   table ... spins: the check's round, as for run; table 0: none (a later step of a call whose check ran
 *             at its first): the first chunk's first synchronisation is an epoch, as every later chunk's
 *   src, dst: C-contiguous buffers of the call's bytes, not overlapping and aligned to their items
 *             (NotImplemented, nothing done, if not); dst private memory, the result unless the node's
 *             ranks all offered a common result block
 *   segs:     bytes, uint64 address of every node rank's window segment (this bucket), local-rank order
 *   itemsize: the dtype's; chunk: bytes per chunk (0: one pass), a multiple of it and above ``direct``
 *   direct:   the largest chunk the window reduces with one synchronisation (the last may be one)
 *   me:       this rank's local rank
 *   controls: bytes, uint64 address of every rank's offer word (empty: no result blocks);
 *   blocks:   bytes, uint64 address of the node's SLOTS result blocks (results.py); offer: the slots this
 *             rank offers, a bit per slot (0 without blocks, and where the last chunk is a short one);
 *   decision: address of this rank's int64 decision word (0 without blocks): the slot every rank offered
 *             (the lowest), whose block the owners write their slices into, or -1 (private results)
 *   counters: address of the node synchronisation's int64 epoch counters; words: bytes, int64 item index
 *             of every rank's counter; epoch: the last epoch this rank posted
 * ShmTransport's reduce-scatter (allreduce.py: _allreduce_contiguous for each chunk) in one call. Per
 * chunk: the slices the peers sum copied into this rank's segment; the first synchronisation (the
 * check's round, this rank's offer published before it, for the first chunk; an epoch after);
 * this rank's slice summed in local-rank order (its own term read from src) block by block, into the
 * node's result block every rank offered, or into dst and then pushed into every peer's segment while in
 * cache; the second synchronisation (an epoch); with private results, the peers' slices copied out of this
 * rank's segment. A last chunk of at most
 * ``direct`` bytes is reduced as the window's one-synchronisation path does (_sum_all): copied in whole,
 * one epoch, every rank's segment summed (the caller then flips the window's bucket).
 * Returns True (done), None (the round posted, a peer late: nothing summed), False (the verdict is not the
 * common one: nothing summed), NotImplemented (nothing done) or 2 * c + p: chunk c's first (p 0) or
 * second (p 1) synchronisation posted and a peer late at it (the caller waits and goes on from there;
 * without a round, 0 is the first chunk's first).
 */
#define SCATTER_BLOCK (64 << 10) /* bytes summed, then pushed while in cache */
#define SLOTS 2                    /* result blocks per node and size (results.py) */
#define SLICE_ALIGN 64             /* slice boundaries on cache lines (allreduce.py, _bounds) */

/* Byte offset where rank i's slice of a chunk of ``count`` items starts: ShmTransport._bounds. */
static Py_ssize_t slice_start(Py_ssize_t count, Py_ssize_t itemsize, Py_ssize_t n, Py_ssize_t i) {
    Py_ssize_t q = SLICE_ALIGN / itemsize > 1 ? SLICE_ALIGN / itemsize : 1;
    Py_ssize_t units = (count + q - 1) / q;
    Py_ssize_t at = units * i / n * q;
    return (at < count ? at : count) * itemsize;
}

/* Post ``epoch`` (after a fence: this rank's stores first) and wait for every rank's: wait_all's result. */
static int post_epoch(volatile int64_t *counters, const int64_t *words, Py_ssize_t n, Py_ssize_t me, int64_t epoch,
                      long spins) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    counters[words[me]] = epoch;
    int arrived = wait_all(counters, words, n, epoch, 1, spins);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the epochs before the peers' stores are read */
    return arrived;
}

static PyObject *lane_scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 23) {
        PyErr_SetString(PyExc_TypeError, "_lane.scatter takes 23 arguments");
        return NULL;
    }
    Round check;
    if (parse_round(args, "scatter", &check) < 0)
        return NULL;
    long spins = check.spins;
    long kind = PyLong_AsLong(args[10]);
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[12]), chunk = PyLong_AsSsize_t(args[13]);
    Py_ssize_t direct = PyLong_AsSsize_t(args[14]), me = PyLong_AsSsize_t(args[15]);
    int64_t offer = PyLong_AsLongLong(args[18]);
    volatile int64_t *counters = (volatile int64_t *)PyLong_AsVoidPtr(args[19]);
    int64_t epoch = PyLong_AsLongLong(args[21]);
    volatile int64_t *decision = (volatile int64_t *)PyLong_AsVoidPtr(args[22]);
    if (PyErr_Occurred())
        return NULL;
    PyObject *const sb = args[11], *cb = args[16], *kb = args[17], *wb = args[20];
    if (!PyBytes_Check(sb) || !PyBytes_Check(cb) || !PyBytes_Check(kb) || !PyBytes_Check(wb) || kind < 0
        || kind >= KIND_COUNT) {
        PyErr_SetString(PyExc_TypeError, "_lane.scatter: segs, controls, blocks and words are bytes, kind a KIND_* "
                                         "value");
        return NULL;
    }
    Py_ssize_t n = check.n;
    Py_ssize_t ncontrols = PyBytes_GET_SIZE(cb) / 8;
    if (PyBytes_GET_SIZE(sb) / 8 != n || PyBytes_GET_SIZE(wb) / 8 != n || me < 0 || me >= n
        || (ncontrols != 0 && (ncontrols != n || PyBytes_GET_SIZE(kb) / 8 != SLOTS || decision == NULL))
        || offer < 0 || offer >= (1 << SLOTS) || (ncontrols == 0 && offer != 0) || itemsize <= 0 || chunk < 0
        || chunk % itemsize || (chunk && chunk <= direct)) {
        PyErr_SetString(PyExc_ValueError, "_lane.scatter: lines, segs, controls and words name the same ranks, "
                                          "me one of them, blocks SLOTS, offer a bit per block (0 without), a "
                                          "decision word with blocks, chunk whole items above direct");
        return NULL;
    }
    const uint64_t *segs = (const uint64_t *)PyBytes_AS_STRING(sb);
    const uint64_t *controls = (const uint64_t *)PyBytes_AS_STRING(cb);
    const uint64_t *blocks = (const uint64_t *)PyBytes_AS_STRING(kb);
    const int64_t *words = (const int64_t *)PyBytes_AS_STRING(wb);
    /* Every argument is checked before the round is posted: an error here leaves the peers' round alone. */
    Py_buffer src, dst;
    if (PyObject_GetBuffer(args[8], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[9], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t len = src.len;
    if (dst.len != len || len % itemsize || len <= direct) {
        PyErr_SetString(PyExc_ValueError, "_lane.scatter: src and dst differ in size, hold no whole items, or take "
                                          "one synchronisation");
        goto done;
    }
    if (chunk == 0 || chunk > len)
        chunk = len;
    if (offer && len % chunk && len % chunk <= direct) {
        PyErr_SetString(PyExc_ValueError, "_lane.scatter: an array whose last chunk takes one synchronisation "
                                          "offers no result block (every rank sums that chunk into its own)");
        goto done;
    }
    uintptr_t s0 = (uintptr_t)src.buf, d0 = (uintptr_t)dst.buf;
    /* The Python path where src and dst overlap (in place: it reads this rank's slice first) or src is not
     * aligned to its items (read as them here), and where a late code would not be one of CPython's cached
     * small ints (nothing may be allocated, so nothing can fail, after the post: 2 * chunks - 1 <= 256). */
    if (!(s0 + (uintptr_t)len <= d0 || d0 + (uintptr_t)len <= s0) || s0 % (uintptr_t)itemsize
        || d0 % (uintptr_t)itemsize || 2 * ((len + chunk - 1) / chunk) - 1 > 256) {
        result = Py_NotImplemented;
        Py_INCREF(result);
        goto done;
    }
    char *seg = (char *)(uintptr_t)segs[me], *out = (char *)dst.buf;
    const char *in = (const char *)src.buf;
    {
        char *shared = NULL; /* the node's result block every rank offered, else NULL: private results */
        const char *terms[n];
        for (Py_ssize_t c = 0, off = 0; off < len; c++, off += chunk) {
            Py_ssize_t clen = len - off < chunk ? len - off : chunk;
            if (clen <= direct) { /* the last chunk, short: the window's one-synchronisation reduce */
                memcpy(seg, in + off, (size_t)clen);
                if (!post_epoch(counters, words, n, me, ++epoch, spins)) {
                    result = PyLong_FromSsize_t(2 * c);
                    goto done;
                }
                for (Py_ssize_t j = 0; j < n; j++)
                    terms[j] = (const char *)(uintptr_t)segs[j];
                reduce((int)kind, out + off, terms, n, clen);
                break;
            }
            Py_ssize_t lo = slice_start(clen / itemsize, itemsize, n, me);
            Py_ssize_t hi = slice_start(clen / itemsize, itemsize, n, me + 1);
            memcpy(seg, in + off, (size_t)lo); /* the slices the peers sum; this rank's own is read from src */
            memcpy(seg + hi, in + off + hi, (size_t)(clen - hi));
            if (c == 0 && ncontrols)
                *(volatile int64_t *)(uintptr_t)controls[me] = offer; /* published before the first synchronisation */
            if (c == 0 && check.table != NULL) {
                int common = 0;
                if (!post_round(&check, &common)) {
                    result = Py_None;
                    Py_INCREF(result);
                    goto done;
                }
                if (!common) {
                    result = Py_False;
                    Py_INCREF(result);
                    goto done;
                }
            } else if (!post_epoch(counters, words, n, me, ++epoch, spins)) {
                result = PyLong_FromSsize_t(2 * c);
                goto done;
            }
            if (c == 0 && ncontrols) { /* every rank's offer, read after it: the same decision on every rank */
                int64_t common = (1 << SLOTS) - 1;
                for (Py_ssize_t r = 0; r < n; r++)
                    common &= *(volatile int64_t *)(uintptr_t)controls[r];
                int k = common ? __builtin_ctzll((unsigned long long)common) : -1;
                *decision = k;
                if (k >= 0)
                    shared = (char *)(uintptr_t)blocks[k];
            }
            for (Py_ssize_t at = lo; at < hi; at += SCATTER_BLOCK) {
                Py_ssize_t size = hi - at < SCATTER_BLOCK ? hi - at : SCATTER_BLOCK;
                for (Py_ssize_t j = 0; j < n; j++)
                    terms[j] = j == me ? in + off + at : (const char *)(uintptr_t)segs[j] + at;
                if (shared != NULL) { /* the node's result: written once, pushed nowhere */
                    reduce((int)kind, shared + off + at, terms, n, size);
                    continue;
                }
                reduce((int)kind, out + off + at, terms, n, size);
                for (Py_ssize_t r = 0; r < n; r++) /* push, don't pull (allreduce.py): while the block is in cache */
                    if (r != me)
                        memcpy((char *)(uintptr_t)segs[r] + at, out + off + at, (size_t)size);
            }
            if (!post_epoch(counters, words, n, me, ++epoch, spins)) {
                result = PyLong_FromSsize_t(2 * c + 1);
                goto done;
            }
            if (shared == NULL) {
                memcpy(out + off, seg, (size_t)lo);
                memcpy(out + off + hi, seg + hi, (size_t)(clen - hi));
            }
        }
    }
    result = Py_True;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef lane_methods[] = {
    {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
     "Copy in, post the check's round, spin, judge and sum: True (summed), None (a peer late) or False."},
    {"scatter", (PyCFunction)(void (*)(void))lane_scatter, METH_FASTCALL,
     "The reduce-scatter of one array on one node, its first synchronisation the check's round (table 0: an epoch)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lane_module = {
    PyModuleDef_HEAD_INIT, "_lane", "The compiled lane of a repeated one-array all-reduce on one node.", -1,
    lane_methods,
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
