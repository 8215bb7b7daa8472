/* C loops over the list of NumPy arrays of an all-reduce call: match it against a planned signature, pack it.
 *
 * A fused call of many arrays spends more time visiting the arrays (their type, shape and dtype for the
 * signature, then the copy of each into the bucket) than moving their bytes; these loops visit each
 * array once through the buffer protocol (mpistrat/comm/signature.py and fusion.py use them).
 *
 * matches(arrays, ndarray, formats, dims) -> bool
 *   arrays:  list of the call's arrays
 *   ndarray: the exact type every item must have (numpy.ndarray: subclasses take the general path)
 *   formats: tuple of bytes, the buffer format of each planned array's dtype
 *   dims:    bytes, int64: for each planned array its ndim, then its shape
 *   True when every item is a C-contiguous ndarray of the planned format, ndim and shape, in order.
 *   Never raises for an item that does not match (False); raises TypeError only for malformed plans.
 *
 * pack(arrays, ndarray, members, out) -> bool
 *   members: tuple of int, the indices of the arrays to copy, in order; out: a writable C-contiguous
 *   buffer. Copies each member's bytes after the previous one's (NumPy's concatenate(axis=None) of
 *   C-contiguous arrays); False, with nothing copied, when a member is not exactly an ndarray (a
 *   subclass's buffer or concatenate may be its own), not C-contiguous, or the members' bytes are not
 *   exactly out's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *matches(PyObject *self, PyObject *args) {
    PyObject *arrays, *ndarray, *formats;
    Py_buffer dims;
    if (!PyArg_ParseTuple(args, "O!OO!y*", &PyList_Type, &arrays, &ndarray, &PyTuple_Type, &formats, &dims))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    const int64_t *d = (const int64_t *)dims.buf;
    Py_ssize_t nd = dims.len / (Py_ssize_t)sizeof(int64_t), at = 0;
    int ok = n == PyTuple_GET_SIZE(formats);
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *a = PyList_GET_ITEM(arrays, i);
        PyObject *fmt = PyTuple_GET_ITEM(formats, i);
        if ((PyObject *)Py_TYPE(a) != ndarray || !PyBytes_Check(fmt) || at >= nd) {
            ok = 0;
            break;
        }
        Py_buffer v;
        if (PyObject_GetBuffer(a, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear(); /* not C-contiguous, or no buffer: the general path says why, if anything */
            ok = 0;
            break;
        }
        int64_t ndim = d[at++];
        ok = v.ndim == ndim && at + ndim <= nd && v.format != NULL && strcmp(v.format, PyBytes_AS_STRING(fmt)) == 0;
        for (int k = 0; ok && k < v.ndim; k++)
            ok = v.shape[k] == d[at + k];
        at += ok ? ndim : 0;
        PyBuffer_Release(&v);
    }
    ok = ok && at == nd;
    PyBuffer_Release(&dims);
    return PyBool_FromLong(ok);
}

static PyObject *pack(PyObject *self, PyObject *args) {
    PyObject *arrays, *ndarray, *members;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "O!OO!w*", &PyList_Type, &arrays, &ndarray, &PyTuple_Type, &members, &out))
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(members);
    Py_buffer *views = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(Py_buffer));
    if (views == NULL) {
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0, total = 0;
    int ok = PyBuffer_IsContiguous(&out, 'C');
    for (; ok && got < m; got++) {
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(members, got));
        if (j < 0 || j >= PyList_GET_SIZE(arrays) || (PyObject *)Py_TYPE(PyList_GET_ITEM(arrays, j)) != ndarray) {
            if (PyErr_Occurred())
                PyErr_Clear();
            ok = 0;
            break;
        }
        if (PyObject_GetBuffer(PyList_GET_ITEM(arrays, j), &views[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            ok = 0;
            break;
        }
        total += views[got].len;
    }
    ok = ok && total == out.len;
    if (ok) { /* every member checked before any byte is written */
        char *dst = (char *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < m; k++) {
            memcpy(dst, views[k].buf, (size_t)views[k].len);
            dst += views[k].len;
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t k = 0; k < got; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyBuffer_Release(&out);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"matches", matches, METH_VARARGS, "Whether a list of arrays matches a planned signature (see the module)."},
    {"pack", pack, METH_VARARGS, "Copy the members' bytes, in order, into out (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_arraylist",
                                    "C loops over an all-reduce call's list of NumPy arrays.", -1, methods};

PyMODINIT_FUNC PyInit__arraylist(void) { return PyModule_Create(&module); }
