/* The optimizers' update rules in one pass over each array, with the bits of train/kernels.py's NumPy rules.
 *
 * Each rule reads and writes every array once, element by element, where NumPy's rules pass over a
 * scratch block per operation. Per element it does the operations of kernels.py's rule, in its order and
 * precision: every coefficient rounded to the arrays' dtype first (NumPy casts a Python float so), each
 * product, sum, quotient and square root rounded to the dtype (IEEE, FLT_EVAL_METHOD 0, nothing
 * contracted into a fused multiply-add: setup.py builds with -ffp-contract=off).
 *
 * sgd(param, grad, lr)                                   param -= lr * grad
 * momentum(param, velocity, grad, lr, mu, nesterov)      velocity = mu * velocity - lr * grad;
 *                                                        param += velocity (nesterov: mu * velocity - lr * grad)
 * adam(param, m, v, grad, lr, beta_1, keep_1, beta_2, keep_2, epsilon)
 *                                                        m = beta_1 m + keep_1 grad; v = beta_2 v + keep_2 grad^2;
 *                                                        param -= lr * m / (sqrt(v) + epsilon)
 * The arrays: C-contiguous buffers of native float32 ("f") or float64 ("d"), one format and length,
 * aligned to their items, no two overlapping, all but grad writable. Returns NotImplemented (nothing
 * written) for any other buffers, else the IEEE exceptions the rule's arithmetic raised (not the
 * coefficients' rounding) as NumPy numbers them (1 divide, 2 overflow, 4 underflow, 8 invalid); the
 * caller reports them. The loops run without the GIL.
 *
 * Where two NaN operands meet, the result is a NaN whose sign and payload may differ from NumPy's: the
 * compiler may swap the operands of + and *, and x86 keeps the first operand's NaN. Every other result
 * is NumPy's, bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fenv.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__FAST_MATH__) || (defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD != 0)
#error "the update rules need IEEE arithmetic (no -ffast-math, FLT_EVAL_METHOD 0): built without them"
#endif

#define MAX_ARRAYS 4

enum { F32, F64 };

/* NumPy's floating-point error numbers (NPY_FPE_*). */
static int numpy_flags(int raised) {
    return ((raised & FE_DIVBYZERO) ? 1 : 0) | ((raised & FE_OVERFLOW) ? 2 : 0) |
           ((raised & FE_UNDERFLOW) ? 4 : 0) | ((raised & FE_INVALID) ? 8 : 0);
}

typedef struct {
    Py_buffer views[MAX_ARRAYS];
    int count;
} Arrays;

static void release(Arrays *a) {
    for (int i = 0; i < a->count; i++) PyBuffer_Release(&a->views[i]);
    a->count = 0;
}

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0 = (uintptr_t)a->buf, b0 = (uintptr_t)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + (uintptr_t)b->len && b0 < a0 + (uintptr_t)a->len;
}

/* The buffers of objs (the last one read-only, the others written); its kind (F32 or F64), or -1 with
 * every buffer released and no error set where they are not what the rules take. */
static int get_arrays(Arrays *a, PyObject **objs, int n, Py_ssize_t *items) {
    a->count = 0;
    for (int i = 0; i < n; i++) {
        int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (i < n - 1 ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[i], &a->views[i], flags) < 0) {
            PyErr_Clear();
            release(a);
            return -1;
        }
        a->count++;
    }
    const char *format = a->views[0].format;
    int kind = -1;
    if (format != NULL && strcmp(format, "f") == 0 && a->views[0].itemsize == 4) kind = F32;
    if (format != NULL && strcmp(format, "d") == 0 && a->views[0].itemsize == 8) kind = F64;
    for (int i = 0; i < n && kind >= 0; i++) {
        if (a->views[i].format == NULL || strcmp(a->views[i].format, format) != 0 ||
            a->views[i].len != a->views[0].len || a->views[i].itemsize != a->views[0].itemsize ||
            (uintptr_t)a->views[i].buf % (uintptr_t)a->views[i].itemsize != 0)
            kind = -1;
        for (int j = 0; j < i && kind >= 0; j++)
            if (overlap(&a->views[i], &a->views[j])) kind = -1;
    }
    if (kind < 0) {
        release(a);
        return -1;
    }
    *items = a->views[0].len / a->views[0].itemsize;
    return kind;
}

#define SGD_LOOP(T)                                                                                   \
    do {                                                                                              \
        T *p = (T *)a.views[0].buf;                                                                   \
        const T *g = (const T *)a.views[1].buf;                                                       \
        const T c_lr = (T)lr;                                                                         \
        feclearexcept(FE_ALL_EXCEPT);                                                                 \
        for (Py_ssize_t i = 0; i < n; i++) {                                                          \
            T t = g[i] * c_lr;                                                                        \
            p[i] = p[i] - t;                                                                          \
        }                                                                                             \
    } while (0)

#define MOMENTUM_LOOP(T)                                                                              \
    do {                                                                                              \
        T *p = (T *)a.views[0].buf, *v = (T *)a.views[1].buf;                                         \
        const T *g = (const T *)a.views[2].buf;                                                       \
        const T c_lr = (T)lr, c_mu = (T)mu;                                                           \
        feclearexcept(FE_ALL_EXCEPT);                                                                 \
        if (nesterov) {                                                                               \
            for (Py_ssize_t i = 0; i < n; i++) {                                                      \
                T u = g[i] * c_lr;                                                                    \
                T nv = v[i] * c_mu - u;                                                               \
                v[i] = nv;                                                                            \
                p[i] = p[i] + (nv * c_mu - u);                                                        \
            }                                                                                         \
        } else {                                                                                      \
            for (Py_ssize_t i = 0; i < n; i++) {                                                      \
                T nv = v[i] * c_mu - g[i] * c_lr;                                                     \
                v[i] = nv;                                                                            \
                p[i] = p[i] + nv;                                                                     \
            }                                                                                         \
        }                                                                                             \
    } while (0)

#define ADAM_LOOP(T, SQRT)                                                                            \
    do {                                                                                              \
        T *p = (T *)a.views[0].buf, *m = (T *)a.views[1].buf, *v = (T *)a.views[2].buf;               \
        const T *g = (const T *)a.views[3].buf;                                                       \
        const T c_lr = (T)lr, c_b1 = (T)beta_1, c_k1 = (T)keep_1, c_b2 = (T)beta_2, c_k2 = (T)keep_2; \
        const T c_eps = (T)epsilon;                                                                   \
        feclearexcept(FE_ALL_EXCEPT);                                                                 \
        for (Py_ssize_t i = 0; i < n; i++) {                                                          \
            T gi = g[i];                                                                              \
            T nm = m[i] * c_b1 + gi * c_k1;                                                           \
            T nv = v[i] * c_b2 + (gi * gi) * c_k2;                                                    \
            m[i] = nm;                                                                                \
            v[i] = nv;                                                                                \
            p[i] = p[i] - (nm * c_lr) / (SQRT(nv) + c_eps);                                           \
        }                                                                                             \
    } while (0)

/* Runs BODY (which clears the IEEE flags after rounding its coefficients) on the buffers without the
 * GIL, between a save and a restore of the thread's flags; returns the flags its loop raised,
 * NumPy-numbered. */
#define RUN_RULE(BODY)                                                                                \
    do {                                                                                              \
        fexcept_t saved;                                                                              \
        int raised;                                                                                   \
        Py_BEGIN_ALLOW_THREADS                                                                        \
        fegetexceptflag(&saved, FE_ALL_EXCEPT);                                                       \
        BODY;                                                                                         \
        raised = fetestexcept(FE_ALL_EXCEPT);                                                         \
        fesetexceptflag(&saved, FE_ALL_EXCEPT);                                                       \
        Py_END_ALLOW_THREADS                                                                          \
        release(&a);                                                                                  \
        return PyLong_FromLong(numpy_flags(raised));                                                  \
    } while (0)

static PyObject *sgd(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    double lr;
    if (!PyArg_ParseTuple(args, "OOd:sgd", &objs[0], &objs[1], &lr)) return NULL;
    Arrays a;
    Py_ssize_t n;
    int kind = get_arrays(&a, objs, 2, &n);
    if (kind < 0) Py_RETURN_NOTIMPLEMENTED;
    if (kind == F32) RUN_RULE(SGD_LOOP(float));
    RUN_RULE(SGD_LOOP(double));
}

static PyObject *momentum(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    double lr, mu;
    int nesterov;
    if (!PyArg_ParseTuple(args, "OOOddp:momentum", &objs[0], &objs[1], &objs[2], &lr, &mu, &nesterov))
        return NULL;
    Arrays a;
    Py_ssize_t n;
    int kind = get_arrays(&a, objs, 3, &n);
    if (kind < 0) Py_RETURN_NOTIMPLEMENTED;
    if (kind == F32) RUN_RULE(MOMENTUM_LOOP(float));
    RUN_RULE(MOMENTUM_LOOP(double));
}

static PyObject *adam(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    double lr, beta_1, keep_1, beta_2, keep_2, epsilon;
    if (!PyArg_ParseTuple(args, "OOOOdddddd:adam", &objs[0], &objs[1], &objs[2], &objs[3], &lr, &beta_1, &keep_1,
                          &beta_2, &keep_2, &epsilon))
        return NULL;
    Arrays a;
    Py_ssize_t n;
    int kind = get_arrays(&a, objs, 4, &n);
    if (kind < 0) Py_RETURN_NOTIMPLEMENTED;
    if (kind == F32) RUN_RULE(ADAM_LOOP(float, sqrtf));
    RUN_RULE(ADAM_LOOP(double, sqrt));
}

static PyMethodDef methods[] = {
    {"sgd", sgd, METH_VARARGS, "param -= lr * grad, in one pass (see the module)."},
    {"momentum", momentum, METH_VARARGS, "Momentum SGD's update, in one pass (see the module)."},
    {"adam", adam, METH_VARARGS, "Adam's update, in one pass (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_update",
                                    "The optimizers' update rules in one pass over each array.", -1, methods};

PyMODINIT_FUNC PyInit__update(void) { return PyModule_Create(&module); }
