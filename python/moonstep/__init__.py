"""moonstep from Python: a ctypes bridge over the C embedding API (moonstep.h, "Embedding"); no compiled code.

    import numpy as np, moonstep
    w, gw = np.zeros(16, np.float32), np.zeros(16, np.float32)
    opt = moonstep.Optimizer({"w": (w, gw)}, "adamw", options={"lr": 1e-2},
                             settings={"schedule": {"kind": "cosine", "warmup_steps": 10, "total_steps": 500}})
    for step in range(500):
        gw[:] = 2 * (w - 1)  # the gradient (here of |w - 1|^2), into the registered buffer
        opt.step()           # w is updated in place

Parameters and gradients are never copied: NumPy arrays are wrapped (ms_tensor_wrap, on a CPU context);
PyTorch and CuPy tensors, and anything else with __dlpack__ / __dlpack_device__, are imported through DLPack
(CUDA tensors on a CUDA context bound to the framework's current stream).  TorchOptimizer (imported on
first use, with torch) is a torch.optim.Optimizer: step, zero_grad, state_dict / load_state_dict and
param_groups[0]["lr"], so torch LR schedulers drive it; its load_state_dict also takes a torch.optim.AdamW
state dict for the parameters moonstep routes to AdamW.  With capturable=True its step can be recorded inside
torch.cuda.graph, and prepare_replay() readies each replay (see TorchOptimizer).

Several ranks (README, "Multi-GPU"): a Comm joins one process per GPU (from the launcher's environment, or from
an NCCL id that rank 0 makes with comm_unique_id() and the trainer broadcasts, e.g. with torch.distributed);
Optimizer(..., comm=) and TorchOptimizer(..., comm=, shards=, distribute=) then run as one rank of that world.

The library: MOONSTEP_LIBRARY (or MOONSTEP_LIB), else build/libmoonstep.so of the source tree this file
is in (MOONSTEP_BUILD names another build folder), else the system's libmoonstep.
"""
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import json
import math
import os
import tempfile
import threading
import warnings
import weakref

__all__ = ["Optimizer", "Context", "Comm", "MoonstepError", "TorchOptimizer", "comm_unique_id", "version",
           "library_path"]

# ---------------------------------------------------------------------------------------------------
# The library
# ---------------------------------------------------------------------------------------------------
_F32, _F64, _BF16, _F16, _I32, _U8 = 0, 1, 2, 3, 4, 5
_DTYPE_CODES = {"float32": _F32, "float64": _F64, "bfloat16": _BF16, "float16": _F16, "int32": _I32, "uint8": _U8}
_KDL_CPU, _KDL_CUDA = 1, 2


class _CtxOptions(ctypes.Structure):
    _fields_ = [("mem_limit", ctypes.c_int64), ("stream", ctypes.c_void_p), ("num_threads", ctypes.c_int)]


class _StepOptions(ctypes.Structure):
    _fields_ = [("grad_scale", ctypes.c_double)]


class _CommOptions(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int), ("world_size", ctypes.c_int), ("unique_id", ctypes.c_char_p),
                ("addr", ctypes.c_char_p), ("port", ctypes.c_int), ("timeout_ms", ctypes.c_int)]


class _Shard(ctypes.Structure):
    _fields_ = [("dim", ctypes.c_int), ("offset", ctypes.c_int64), ("global_size", ctypes.c_int64)]


_COMM_ID_BYTES = 128
_SHARD_DIMS = {"rows": 1, "cols": 2}


# the moonstep.h this module's ctypes declarations follow (MS_ABI_VERSION); another library is refused
ABI_VERSION = 2


def _library_candidates():
    for var in ("MOONSTEP_LIBRARY", "MOONSTEP_LIB"):
        path = os.environ.get(var)
        if path:
            return [path]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    build = os.environ.get("MOONSTEP_BUILD", "build")
    folder = build if os.path.isabs(build) else os.path.join(root, build)
    found = ctypes.util.find_library("moonstep")
    return [os.path.join(folder, "libmoonstep.so")] + ([found] if found else []) + ["libmoonstep.so.%d" % ABI_VERSION]


def _load_library():
    tried = []
    for path in _library_candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            # PyDLL: calls keep the GIL.  Any call may run the optimizer's Lua garbage collector, whose
            # finalizers call DLPack deleters, and not every producer's deleter takes the GIL itself.
            return ctypes.PyDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError("moonstep: cannot load libmoonstep; tried " + ", ".join(tried) +
                      " (set MOONSTEP_LIBRARY, or run `make`)")


_lib, library_path = _load_library()

_P, _PP, _S = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p
for _name, _res, _args in [
    ("ms_status_name", _S, [ctypes.c_int]),
    ("ms_last_error", _S, []),
    ("ms_version", _S, []),
    ("ms_abi_version", ctypes.c_int, []),
    ("ms_ctx_new", ctypes.c_int, [_S, ctypes.POINTER(_CtxOptions), _PP]),
    ("ms_ctx_free", None, [_P]),
    ("ms_ctx_device_name", _S, [_P]),
    ("ms_ctx_device_type", ctypes.c_int, [_P]),
    ("ms_ctx_device_index", ctypes.c_int, [_P]),
    ("ms_ctx_stream", _P, [_P]),
    ("ms_ctx_sync", ctypes.c_int, [_P]),
    ("ms_device_count", ctypes.c_int, [ctypes.c_int]),
    ("ms_tensor_wrap", ctypes.c_int, [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                      ctypes.POINTER(ctypes.c_int64), _PP]),
    ("ms_tensor_from_dlpack", ctypes.c_int, [_P, _P, _PP]),
    ("ms_tensor_free", None, [_P]),
    ("ms_tensor_data_ptr", _P, [_P]),
    ("ms_tensor_dtype", ctypes.c_int, [_P]),
    ("ms_tensor_ndim", ctypes.c_int, [_P]),
    ("ms_tensor_size", ctypes.c_int64, [_P, ctypes.c_int]),
    ("ms_tensor_stride", ctypes.c_int64, [_P, ctypes.c_int]),
    ("ms_ctx_is_capturing", ctypes.c_int, [_P]),
    ("ms_optimizer_new", ctypes.c_int, [_P, _S, _S, _S, _PP]),
    ("ms_optimizer_free", None, [_P]),
    ("ms_optimizer_add_param", ctypes.c_int, [_P, _S, _P, _P, _S]),
    ("ms_optimizer_set_grad", ctypes.c_int, [_P, _S, _P]),
    ("ms_optimizer_step_with", ctypes.c_int, [_P, ctypes.POINTER(_StepOptions), ctypes.POINTER(ctypes.c_int)]),
    ("ms_optimizer_set_lr", ctypes.c_int, [_P, ctypes.c_double]),
    ("ms_optimizer_get_lr", ctypes.c_int, [_P, ctypes.POINTER(ctypes.c_double)]),
    ("ms_optimizer_save", ctypes.c_int, [_P, _S]),
    ("ms_optimizer_load", ctypes.c_int, [_P, _S]),
    ("ms_optimizer_info", ctypes.c_int, [_P, _PP]),
    ("ms_optimizer_stats", ctypes.c_int, [_P, _PP]),
    ("ms_optimizer_capture", ctypes.c_int, [_P]),
    ("ms_optimizer_prepare_replay_with", ctypes.c_int, [_P, ctypes.POINTER(_StepOptions)]),
    ("ms_string_free", None, [_P]),
    ("ms_optimizer_set_comm", ctypes.c_int, [_P, _P]),
    ("ms_optimizer_add_param_sharded", ctypes.c_int, [_P, _S, _P, _P, _S, ctypes.POINTER(_Shard)]),
    ("ms_comm_unique_id", ctypes.c_int, [ctypes.c_char_p]),
    ("ms_comm_new", ctypes.c_int, [_P, ctypes.POINTER(_CommOptions), _PP]),
    ("ms_comm_new_from_env", ctypes.c_int, [_P, ctypes.c_int, _PP]),
    ("ms_comm_free", None, [_P]),
    ("ms_comm_rank", ctypes.c_int, [_P]),
    ("ms_comm_size", ctypes.c_int, [_P]),
]:
    _fn = getattr(_lib, _name)
    _fn.restype, _fn.argtypes = _res, _args

_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype, _capsule_get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype, _capsule_set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
# the capsule keeps this pointer: the bytes object lives as long as the module
_USED_DLTENSOR = b"used_dltensor"


if _lib.ms_abi_version() != ABI_VERSION:
    raise ImportError("moonstep: %s has ABI %d, this module declares ABI %d (rebuild, or use the matching "
                      "python/moonstep)" % (library_path, _lib.ms_abi_version(), ABI_VERSION))


def version():
    """The library's version string, e.g. "0.1.0"."""
    return _lib.ms_version().decode()


class MoonstepError(RuntimeError):
    """A moonstep call failed: `status` is the status name ("MS_E_SHAPE", ...), the text its message."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def _check(status):
    if status != 0:
        raise MoonstepError(_lib.ms_status_name(status).decode(), _lib.ms_last_error().decode(errors="replace"))


def _check_named(status, what):
    """_check for an import, whose message names the engine's argument (ptr, managed): `what` names the caller's
    (the parameter or gradient)."""
    if status != 0:
        raise MoonstepError(_lib.ms_status_name(status).decode(),
                            "%s: %s" % (what, _lib.ms_last_error().decode(errors="replace")))


def _unwritable(v, where):
    """Where v (a JSON-bound value) holds what JSON cannot, as ("'lr'", "a finite number is needed (got nan)")
    or ("'betas' item 2", ...): a NaN or infinity, or a value that is no number, string, boolean, None, list or
    dict; None when there is none."""
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return where, "a finite number is needed (got %r)" % v
    if v is None or isinstance(v, (str, bool, int, float)):
        return None
    if not isinstance(v, (dict, list, tuple)):
        return where, ("a value of type %s cannot be written as JSON (numbers, strings, booleans, None, lists and "
                       "dicts can)" % type(v).__name__)
    items = v.items() if isinstance(v, dict) else enumerate(v, 1)
    for k, x in items:
        found = _unwritable(x, "%s item %d" % (where, k) if isinstance(k, int) and not isinstance(v, dict) else
                            "'%s'" % k if where == "" else "%s ['%s']" % (where, k))
        if found:
            return found
    return None


def _json(value, what):
    """JSON text of options or settings (what: "option" or "setting"); NumPy and torch scalars and arrays become
    numbers and lists.  JSON has no NaN or infinity, so one is refused here, named as the engine names a bad
    value (MS_E_ARG), where the engine would only see text that is not JSON; so is a value JSON cannot hold."""
    if value is not None and not isinstance(value, dict):
        raise TypeError("%ss must be a dict {name: value} (got %s)" % (what, type(value).__name__))
    found = _unwritable(value or {}, "")
    if found:
        raise MoonstepError("MS_E_ARG", "ms_optimizer_new: %s %s: %s" % (what, found[0], found[1]))

    def plain(x):
        return x.tolist()         # (_unwritable let only these through)
    return json.dumps(value or {}, default=plain).encode()


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _no_nul(text, what, shown):
    """text (bytes for the library, which reads up to the first NUL: "a\\0b" would reach it as "a") unless it
    holds a NUL character; shown: the caller's value, for the message."""
    if b"\0" in text:
        raise ValueError("%s must not hold a NUL character (got %r)" % (what, shown))
    return text


def _path(p, what):
    """A filesystem path (str, bytes or os.PathLike) as the bytes the OS takes: os.fsencode, so names that are
    not UTF-8 (str with surrogate escapes, raw bytes) reach the file they name."""
    try:
        return _no_nul(os.fsencode(p), what, p)
    except TypeError:
        raise TypeError("%s must be a path (str, bytes or os.PathLike; got %s)" % (what, type(p).__name__)) from None


def _utf8(s, what):
    if not isinstance(s, str):
        raise TypeError("%s must be a string (got %s)" % (what, type(s).__name__))
    return _no_nul(s.encode(), what, s)


def _locked(fn):
    """fn(self, ...) holding self._lock, an RLock: close() (also run from another thread, or by the garbage
    collector's __del__) cannot free the handle between a method's reading it and the library's using it."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return call


def _lock_of(obj):
    """obj's lock; none where __init__ did not get to make it (__del__ of a half-made object, no one's to share)."""
    lock = getattr(obj, "_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------
# Contexts and tensors
# ---------------------------------------------------------------------------------------------------
def _refuse_close_under(obj, what):
    """Raises while an open Optimizer made with obj (a Context or a Comm, which keep them in _users) still uses it:
    closing it first would leave that optimizer's next call on a freed handle."""
    users = getattr(obj, "_users", ())
    if any(getattr(o, "_opt", None) for o in users):
        gc.collect()   # optimizers that only a reference cycle keeps are no one's to use
    open_users = [o for o in users if getattr(o, "_opt", None)]
    if open_users and getattr(obj, "_h", None):
        raise ValueError("the %s is used by %d open optimizer(s): close the optimizer first" % (what, len(open_users)))


class Context:
    """A moonstep context: a device ("cpu", "cuda", "cuda:N", or "auto": the first GPU where there is one,
    else the CPU) and, on CUDA, the stream its work is queued on (a cudaStream_t as an int; None: a stream of
    its own).  num_threads: OpenMP threads for its CPU work (0: OpenMP's default); mem_limit: bytes it may
    hold allocated at once (0: no limit)."""

    def __init__(self, device="cpu", stream=None, num_threads=0, mem_limit=0):
        self._lock = threading.RLock()    # held by every call on the handle, and by close (see _locked)
        self._h = None
        self._users = weakref.WeakSet()   # the Optimizers on it, which wrap their gradients through its handle
        opts = _CtxOptions(_integer(mem_limit, "mem_limit"), _integer(stream, "stream") if stream else None,
                           _integer(num_threads, "num_threads"))
        handle = ctypes.c_void_p()
        _check(_lib.ms_ctx_new(_utf8(device, "device"), ctypes.byref(opts), ctypes.byref(handle)))
        self._h = handle

    def _handle(self):
        """The handle, for a call made holding self._lock."""
        if not self._h:
            raise ValueError("the context is closed")
        return self._h

    @property
    @_locked
    def device(self):
        return _lib.ms_ctx_device_name(self._handle()).decode()

    @property
    @_locked
    def is_cuda(self):
        return _lib.ms_ctx_device_type(self._handle()) == 1

    @property
    @_locked
    def index(self):
        return _lib.ms_ctx_device_index(self._handle())

    @property
    @_locked
    def stream(self):
        """The cudaStream_t (an int) this context's work runs on; None on the CPU."""
        return _lib.ms_ctx_stream(self._handle())

    @_locked
    def sync(self):
        _check(_lib.ms_ctx_sync(self._handle()))

    @_locked
    def close(self):
        """Frees the context, after the optimizers on it: refused while one of them is open (its set_grad and
        add_param would find no context to wrap the tensors on).  Afterwards its properties and sync() raise
        ValueError, as does an Optimizer or Comm made on it."""
        _refuse_close_under(self, "context")
        self._free()

    def _free(self):
        with _lock_of(self):
            h, self._h = getattr(self, "_h", None), None     # detached first: no call finds it freed
            if h and _lib is not None:
                _lib.ms_ctx_free(h)

    __del__ = _free   # garbage: an optimizer that still held it is garbage too

    @_locked
    def __repr__(self):
        return "moonstep.Context(%s)" % (self.device if self._h else "closed")


# ---------------------------------------------------------------------------------------------------
# Communicators
# ---------------------------------------------------------------------------------------------------
def comm_unique_id():
    """A new NCCL unique id (128 bytes), made on rank 0 and handed to every rank (e.g. with
    torch.distributed.broadcast_object_list) for Comm(rank, world_size, unique_id)."""
    buf = ctypes.create_string_buffer(_COMM_ID_BYTES)
    _check(_lib.ms_comm_unique_id(buf))
    return buf.raw


def _timeout_ms(seconds):
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds * 1000 < 2 ** 31:
        raise ValueError("timeout must be a positive number of seconds (got %r)" % (seconds,))
    return max(1, int(round(seconds * 1000)))


def _integer(v, what):
    if isinstance(v, bool) or not hasattr(v, "__index__"):      # ints, NumPy's too; not floats
        raise TypeError("%s must be an integer (got %r)" % (what, v))
    return v.__index__()


def _default_device():
    """cuda:LOCAL_RANK where there are CUDA devices (one GPU per rank, as the launchers expect), else cpu."""
    if _lib.ms_device_count(1) > 0:
        return "cuda:%d" % int(os.environ.get("LOCAL_RANK", "0"))
    return "cpu"


class Comm:
    """This process's rank of a job of world_size ranks (moonstep.h, "Communicators"): NCCL on CUDA contexts.
    Hand it to Optimizer(..., comm=) or TorchOptimizer(..., comm=) on every rank; it must outlive them (they
    keep a reference).  Its context is the optimizer's: the step's collectives are queued on its stream.

        Comm.from_env()                    # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (moonstep launch)
        id = moonstep.comm_unique_id() if rank == 0 else None
        box = [id]; torch.distributed.broadcast_object_list(box, src=0)
        Comm(rank, world_size, box[0])    # the id from the trainer's own process group (torchrun)

    device: default cuda:LOCAL_RANK (cpu without CUDA devices); stream: a cudaStream_t (int) for the context
    (None: a stream of its own, ordered after the framework's work with events); context: a Context instead.
    Without unique_id, the ranks meet at addr:port (default MASTER_ADDR, MASTER_PORT): under torchrun that port
    is torch's own store once torch.distributed is initialized, so pass the id there, or another port.
    timeout: seconds (default 300) for the rendezvous and NCCL's set-up."""

    def __init__(self, rank, world_size, unique_id=None, device=None, stream=None, context=None, addr=None, port=None,
                 timeout=None):
        self._lock = threading.RLock()    # held by every call on the handle, and by close (see _locked)
        self._h = None
        self._users = weakref.WeakSet()   # the Optimizers made with it, which hold its pointer
        rank, world_size = _integer(rank, "rank"), _integer(world_size, "world_size")
        if unique_id is not None:
            if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != _COMM_ID_BYTES:
                raise ValueError("unique_id must be %d bytes (moonstep.comm_unique_id() on rank 0; got %s)"
                                 % (_COMM_ID_BYTES, "%d bytes" % len(unique_id)
                                    if isinstance(unique_id, (bytes, bytearray)) else type(unique_id).__name__))
            unique_id = bytes(unique_id)
        opts = _CommOptions(rank, world_size, unique_id, _utf8(addr, "addr") if addr is not None else None,
                            _integer(port, "port") if port is not None else 0, _timeout_ms(timeout))
        self.context = self._context(device, stream, context)
        handle = ctypes.c_void_p()
        with self.context._lock:
            _check(_lib.ms_comm_new(self.context._handle(), ctypes.byref(opts), ctypes.byref(handle)))
        self._h = handle

    @classmethod
    def from_env(cls, device=None, stream=None, context=None, timeout=None):
        """A Comm from the launcher's environment: RANK, WORLD_SIZE, and MASTER_ADDR, MASTER_PORT for the
        rendezvous (moonstep launch, torchrun before torch.distributed takes the port)."""
        self = cls.__new__(cls)
        self._lock = threading.RLock()
        self._h = None
        self._users = weakref.WeakSet()
        ms_timeout = _timeout_ms(timeout)
        self.context = cls._context(device, stream, context)
        handle = ctypes.c_void_p()
        with self.context._lock:
            _check(_lib.ms_comm_new_from_env(self.context._handle(), ms_timeout, ctypes.byref(handle)))
        self._h = handle
        return self

    @staticmethod
    def _context(device, stream, context):
        if context is not None:
            if device is not None or stream is not None:
                raise ValueError("give a context, or a device and stream, not both")
            if not isinstance(context, Context):
                raise TypeError("context must be a moonstep.Context (got %s)" % type(context).__name__)
            return context
        return Context(device or _default_device(), stream=stream)

    def _handle(self):
        """The handle, for a call made holding self._lock."""
        if not self._h:
            raise ValueError("the communicator is closed")
        return self._h

    @property
    @_locked
    def rank(self):
        return _lib.ms_comm_rank(self._handle())

    @property
    @_locked
    def world_size(self):
        return _lib.ms_comm_size(self._handle())

    @_locked
    def close(self):
        """Destroys the communicator (on every rank), after the optimizers that use it: refused while one of
        them is open (its next step would use the freed communicator)."""
        _refuse_close_under(self, "communicator")
        self._free()

    def _free(self):
        with _lock_of(self):
            h, self._h = getattr(self, "_h", None), None     # detached first: no call finds it freed
            if h and _lib is not None:
                _lib.ms_comm_free(h)

    __del__ = _free   # garbage: an optimizer that still held it is garbage too, and steps no more

    @_locked
    def __repr__(self):
        if not self._h:
            return "moonstep.Comm(closed)"
        return "moonstep.Comm(rank %d of %d on %s)" % (self.rank, self.world_size, self.context.device)


def _shard(spec, where):
    """An _Shard from (dim, offset, size) or {"dim", "offset", "size"}; dim "rows" | "cols"; None: the whole."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        unknown = set(spec) - {"dim", "offset", "size"}
        if unknown:
            raise ValueError("%s: shard keys %s (dim, offset, size)" % (where, sorted(unknown)))
        spec = (spec.get("dim"), spec.get("offset"), spec.get("size"))
    if not isinstance(spec, (tuple, list)) or len(spec) != 3:
        raise ValueError("%s: a shard is (dim, offset, size) with dim 'rows' or 'cols' (got %r)" % (where, spec))
    dim, offset, size = spec
    if dim not in _SHARD_DIMS:
        raise ValueError("%s: shard dim must be 'rows' (dim -2) or 'cols' (dim -1), got %r" % (where, dim))
    return _Shard(_SHARD_DIMS[dim], _integer(offset, where + ": shard offset"), _integer(size, where + ": shard size"))


def _tags(tags, where):
    """The comma-separated text the engine takes, from a list of strings or such a text; None: no tags."""
    if tags is None:
        return None
    if isinstance(tags, str):
        return _utf8(tags, where + ": tags")
    if not isinstance(tags, (list, tuple)):
        raise TypeError("%s: tags must be a list of strings or a comma-separated string (got %s)"
                        % (where, type(tags).__name__))
    for i, t in enumerate(tags):
        if not isinstance(t, str):
            raise TypeError("%s: tags[%d] must be a string (got %s)" % (where, i, type(t).__name__))
        if "," in t:     # the engine splits at commas: one tag would become two
            raise ValueError("%s: tags[%d] %r holds a comma, which separates tags" % (where, i, t))
        _utf8(t, "%s: tags[%d]" % (where, i))     # (a NUL would end the text there)
    return _utf8(",".join(tags), where + ": tags") if tags else None


def _view(handle):
    """(address, dtype, shape, strides) of an ms_tensor handle: equal for two views of the same elements."""
    n = _lib.ms_tensor_ndim(handle)
    return (_lib.ms_tensor_data_ptr(handle), _lib.ms_tensor_dtype(handle),
            tuple(_lib.ms_tensor_size(handle, d) for d in range(n)),
            tuple(_lib.ms_tensor_stride(handle, d) for d in range(n)))


def _framework(x):
    return type(x).__module__.split(".")[0]


def _is_numpy(x):
    return _framework(x) == "numpy" and hasattr(x, "__array_interface__") and hasattr(x, "ctypes")


def _device_of(x, what):
    """("cpu", 0) or ("cuda", index) of an array or tensor (what: the parameter, for the errors)."""
    if _is_numpy(x):
        return "cpu", 0
    if not hasattr(x, "__dlpack_device__"):
        raise TypeError("%s: expected a NumPy array or a tensor with __dlpack__ (PyTorch, CuPy, ...), got %s"
                        % (what, type(x).__name__))
    kind, index = x.__dlpack_device__()
    kind = int(kind)
    if kind == _KDL_CPU:
        return "cpu", 0
    if kind == _KDL_CUDA:
        return "cuda", int(index)
    raise MoonstepError("MS_E_DEVICE", "%s: a tensor on DLPack device type %d: moonstep takes CPU (1) and CUDA (2) "
                        "memory" % (what, kind))


def _current_stream(framework, index):
    """The framework's current CUDA stream on device `index` as an int (0: the legacy default stream)."""
    if framework == "torch":
        import torch
        return torch.cuda.current_stream(index).cuda_stream
    if framework == "cupy":
        import cupy
        with cupy.cuda.Device(index):
            return cupy.cuda.get_current_stream().ptr
    return 0


def _import(ctx, x, what, writable):
    """A new ms_tensor handle viewing x's memory (the caller frees it).  NumPy arrays must be writable either
    way: writable (a parameter) or not (a gradient) only words the refusal."""
    handle = ctypes.c_void_p()
    if _is_numpy(x):
        if ctx.is_cuda:
            raise MoonstepError("MS_E_DEVICE", "%s: a NumPy array (host memory) for an optimizer on %s" % (what, ctx.device))
        if not x.flags.writeable:
            raise ValueError("%s: the array is read-only, and moonstep %s" % (what, "updates parameters in place"
                             if writable else "rescales gradients in place (clipping, grad_scale)"))
        code = _DTYPE_CODES.get(x.dtype.name)
        if code is None or not x.dtype.isnative:
            raise TypeError("%s: dtype %s is not one of float32, float64, bfloat16, float16 (native byte order)"
                            % (what, x.dtype))
        item = x.dtype.itemsize
        if any(s % item for s in x.strides):
            raise ValueError("%s: strides %s are not whole elements" % (what, x.strides))
        n = max(x.ndim, 1)
        shape = (ctypes.c_int64 * n)(*x.shape)
        strides = (ctypes.c_int64 * n)(*[s // item for s in x.strides])
        with ctx._lock:
            _check_named(_lib.ms_tensor_wrap(ctx._handle(), x.ctypes.data if x.size else None, code, x.ndim, shape,
                                             strides, ctypes.byref(handle)), what)
        return handle
    if not hasattr(x, "__dlpack__"):
        raise TypeError("%s: expected a NumPy array or a tensor with __dlpack__ (PyTorch, CuPy, ...), got %s"
                        % (what, type(x).__name__))
    if _framework(x) == "torch" and x.requires_grad:
        x = x.detach()                   # same memory; torch refuses to export a tensor that requires grad
    # the producer orders its pending work before ctx's stream
    capsule = x.__dlpack__(stream=ctx.stream) if ctx.is_cuda else x.__dlpack__()
    try:
        managed = _capsule_get(capsule, b"dltensor")
    except (ValueError, TypeError):
        raise TypeError("%s: __dlpack__() gave %s, not an unused capsule named 'dltensor' (DLPack 0.6 to 0.8)"
                        % (what, type(capsule).__name__)) from None
    with ctx._lock:
        _check_named(_lib.ms_tensor_from_dlpack(ctx._handle(), managed, ctypes.byref(handle)), what)
    _capsule_set_name(capsule, _USED_DLTENSOR)     # moonstep owns it now: the capsule must not delete it
    return handle


class _StreamOrder:
    """When the framework's current stream is not the context's (its default stream, or the trainer moved to
    another one), orders the step after the framework's queued work and the framework's later work after
    the step, with events.  Inside a graph capture (torch.cuda.graph captures on a stream of its own) the
    same events fork the context's stream into the capture and join it back, so the step is recorded into
    the framework's graph between the work around it."""

    def __init__(self, framework, ctx):
        self.framework, self.index, self.ptr = framework, ctx.index, ctx.stream
        self.ours = None
        self.theirs = None

    def before(self):
        self.theirs = None
        if self.framework == "torch":
            import torch
            cur = torch.cuda.current_stream(self.index)
            if cur.cuda_stream == self.ptr:
                return
            if self.ours is None:
                self.ours = torch.cuda.ExternalStream(self.ptr, device=self.index)
            self.ours.wait_stream(cur)
            self.theirs = cur
        elif self.framework == "cupy":
            import cupy
            with cupy.cuda.Device(self.index):
                cur = cupy.cuda.get_current_stream()
                if cur.ptr == self.ptr:
                    return
                if self.ours is None:
                    self.ours = cupy.cuda.ExternalStream(self.ptr)
                self.ours.wait_event(cur.record())
            self.theirs = cur

    def after(self):
        if self.theirs is None:
            return
        if self.framework == "torch":
            self.theirs.wait_stream(self.ours)
        else:
            import cupy
            with cupy.cuda.Device(self.index):
                self.theirs.wait_event(self.ours.record())
        self.theirs = None


# ---------------------------------------------------------------------------------------------------
# Checkpoint files (safetensors), for the state-dict conversions
# ---------------------------------------------------------------------------------------------------
def _read_safetensors(data):
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n].decode())
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        tensors[name] = [e["dtype"], list(e["shape"]), data[base + begin:base + end]]
    return tensors, meta


def _write_safetensors(tensors, meta):
    header, chunks, offset = {"__metadata__": meta}, [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _host_array(x):
    """A NumPy float32 copy of a tensor or array (torch: on the host)."""
    import numpy as np
    if _framework(x) == "torch":
        import torch
        return x.detach().to("cpu", torch.float32).numpy()
    if _framework(x) == "cupy":
        return x.get().astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def _encode(values, dtype):
    import numpy as np
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    if dtype == "BF16":                              # round to nearest even, as the engine stores bf16
        bits = values.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    raise ValueError("no conversion to %s" % dtype)


# ---------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------
def _entries(params):
    """[(name, param, grad, tags, shard)] from a dict {name: param | (param, grad) | {"param", "grad", "tags",
    "shard"}} or an iterable of (name, param[, grad[, tags[, shard]]]) or {"name", "param", "grad", "tags",
    "shard"}."""
    out = []
    items = params.items() if isinstance(params, dict) else params
    for i, item in enumerate(items):
        if isinstance(params, dict):
            name, spec = item
            if isinstance(spec, dict):
                item = dict(spec, name=name)
            elif isinstance(spec, (tuple, list)):
                item = (name,) + tuple(spec)
            else:
                item = (name, spec)
        if isinstance(item, dict):
            unknown = set(item) - {"name", "param", "grad", "tags", "shard"}
            if unknown:
                raise ValueError("params[%d]: unknown keys %s (name, param, grad, tags, shard)" % (i, sorted(unknown)))
            out.append((item.get("name"), item.get("param"), item.get("grad"), item.get("tags"), item.get("shard")))
        elif isinstance(item, (tuple, list)) and 2 <= len(item) <= 5:
            out.append(tuple(item) + (None,) * (5 - len(item)))
        else:
            raise TypeError("params[%d]: expected (name, param[, grad[, tags[, shard]]]) or a dict" % i)
    return out


def _number(value, what):
    """value as a float, refusing what float() would take silently ("1e-3", True), naming it as `what`; what
    float() refuses (an array of one element) is named too."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise TypeError("%s must be a number (got %r)" % (what, value))
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError("%s must be a number (got %r: %s)" % (what, value, e)) from None


def _grad_scale(value, what):
    """A step's grad_scale as the C call takes it (None: 0, not scaled)."""
    return 0.0 if value is None else _number(value, "%s: grad_scale" % what)


class Optimizer:
    """A moonstep optimizer over NumPy arrays or DLPack tensors (PyTorch, CuPy), updated in place.

    params: {name: param | (param, grad) | {"param", "grad", "tags", "shard"}}, or a list of (name, param, grad,
    tags, shard) tuples or {"name", "param", "grad", "tags", "shard"} dicts.  NumPy arrays are float32, float64,
    float16 or bfloat16 (native byte order) and writable: a parameter C-contiguous, a gradient of its shape
    in any layout that can be written (non-negative strides, no two elements at one address: steps rescale
    gradients in place).  grad may be None and given later (set_grad, or step(grads=...)); tags: a list of
    strings (or "a,b") that the recipe's route() sees; shard: this rank's slice of the parameter, ("rows" |
    "cols", offset, global size of that dim).  One array under several names (tied weights) is one parameter
    with one gradient, given through any of the names (two different ones are refused).
    recipe: a built-in name ("adamw", "sinkgd", ...) or a recipe file (sandboxed unless settings["trusted"]).
    options: the recipe's options; settings: the runtime's (schedule, clip_grad_norm, nonfinite, distribute,
    ...): see moonstep.h, ms_optimizer_new.  context: a Context to run on; by default the comm's, else one for
    the first parameter's device, on CUDA bound to the framework's current stream.  comm: a Comm, the world
    this optimizer is one rank of (moonstep.h, ms_optimizer_set_comm); it must outlive the optimizer.
    """

    def __init__(self, params, recipe="adamw", options=None, settings=None, context=None, comm=None):
        self._lock = threading.RLock()    # held by every call on the handle, and by close (see _locked)
        entries = _entries(params)
        self._opt = None
        self._comm = None
        self._framework = _framework(entries[0][1]) if entries else "numpy"
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError("comm must be a moonstep.Comm (got %s)" % type(comm).__name__)
        if context is not None and not isinstance(context, Context):
            raise TypeError("context must be a moonstep.Context (got %s)" % type(context).__name__)
        if context is None and comm is not None:
            context = comm.context
        if context is None:
            kind, index = _device_of(entries[0][1], "parameter %r" % (entries[0][0],)) if entries else ("cpu", 0)
            if kind == "cuda":
                stream = _current_stream(self._framework, index)
                # the legacy default stream (0) cannot be a context's stream: it gets its own, ordered by events
                context = Context("cuda:%d" % index, stream=stream or None)
            else:
                context = Context("cpu")
        self.context = context
        self._order = _StreamOrder(self._framework, context) if context.is_cuda else None
        handle = ctypes.c_void_p()
        recipe, options, settings = _path(recipe, "recipe"), _json(options, "option"), _json(settings, "setting")
        with context._lock:        # (context.close() checks its users and frees holding it)
            _check(_lib.ms_optimizer_new(context._handle(), recipe, options, settings, ctypes.byref(handle)))
            self._opt = handle
            context._users.add(self)   # context.close() is refused while this optimizer is open
        self.names = []
        self._keep = {}            # name -> [param, grad]: wrapped NumPy memory must outlive the optimizer's use
        self._tie = {}             # name -> its tensor's (address, dtype, shape): names sharing one are tied
        self._tie_names = {}       # that key -> the names
        self._grad_handles = {}    # that key -> the registered gradient's handle (step(grads=) restores it)
        try:
            if comm is not None:
                with comm._lock:
                    _check(_lib.ms_optimizer_set_comm(handle, comm._handle()))
                    self._comm = comm      # kept: the optimizer holds the communicator's pointer
                    comm._users.add(self)  # comm.close() is refused while this optimizer is open
            for name, param, grad, tags, shard in entries:
                self.add_param(name, param, grad, tags, shard)
        except BaseException:
            self.close()           # refused: no half-made optimizer keeps the context or comm from closing
            raise

    def _handle(self):
        """The handle, for a call made holding self._lock (the methods calling the library are _locked)."""
        if not self._opt:
            raise ValueError("the optimizer is closed")
        return self._opt

    def _ordered(self, fn, *args):
        """fn(*args), whose work runs on the context's stream, ordered after the framework's current stream
        (where a graph replay may have written the state) and before its later work."""
        if self._order:
            self._order.before()
        try:
            return fn(*args)
        finally:
            if self._order:
                self._order.after()

    @_locked
    def add_param(self, name, param, grad=None, tags=None, shard=None):
        """Registers a parameter (before the first step, save, load, info or stats); shard: this rank's slice,
        ("rows" | "cols", offset, global size of that dim), None for the whole parameter."""
        if not isinstance(name, str) or not name:
            raise TypeError("a parameter's name must be a non-empty string (got %r)" % (name,))
        self._handle()                   # (closed: said before anything is imported)
        where = "parameter %r" % (name,)
        cname = _utf8(name, "a parameter's name")
        text = _tags(tags, where)
        sh = _shard(shard, where)
        p = _import(self.context, param, where, True)
        try:
            g = _import(self.context, grad, "gradient of %r" % (name,), False) if grad is not None else None
        except Exception:
            _lib.ms_tensor_free(p)
            raise
        try:
            _check(_lib.ms_optimizer_add_param_sharded(self._handle(), cname, p, g, text,
                                                       ctypes.byref(sh) if sh is not None else None))
            tie = _view(p)[:3]           # tied parameters: one tensor (address, dtype, shape) under several names
        except BaseException:
            if g is not None:
                _lib.ms_tensor_free(g)
            raise
        finally:
            _lib.ms_tensor_free(p)       # the optimizer keeps handles of its own
        if g is not None:
            self._remember_grad(tie, g)
        self.names.append(name)
        self._keep[name] = [param, grad]
        self._tie[name] = tie
        names = self._tie_names.setdefault(tie, [])
        names.append(name)
        if grad is not None:             # the tie's one gradient, whichever name gave it
            for n in names:
                self._keep[n][1] = grad
        elif len(names) > 1:
            self._keep[name][1] = self._keep[names[0]][1]

    def _import_grad(self, name, grad):
        return _import(self.context, grad, "gradient of %r" % (name,), False) if grad is not None else None

    def _set_grad(self, name, grad, g):
        """set_grad with grad already imported as handle g (None for none), which the caller frees."""
        _check(_lib.ms_optimizer_set_grad(self._handle(), _utf8(name, "name"), g))
        for n in self._tie_names.get(self._tie.get(name), ()):   # a tie's one gradient, through any of its names
            self._keep[n][1] = grad

    def _remember_grad(self, tie, g):
        """Keeps handle g (or None) of the tie's registered gradient, freeing the one it replaces: step(grads=)
        hands it back after the step without importing the gradient again."""
        old = self._grad_handles.pop(tie, None)
        if g is not None:
            self._grad_handles[tie] = g
        if old is not None and _lib is not None:
            _lib.ms_tensor_free(old)

    def _restore_grad(self, name, grad):
        """After step(grads=): the tie of `name` gets back its registered gradient `grad`, whose handle is kept."""
        tie = self._tie[name]
        _check(_lib.ms_optimizer_set_grad(self._handle(), _utf8(name, "name"), self._grad_handles.get(tie)))
        for n in self._tie_names.get(tie, ()):
            self._keep[n][1] = grad

    @_locked
    def set_grad(self, name, grad):
        """Gives parameter `name` another gradient (None: none; steps then leave it alone).  For a tied
        parameter (one tensor under several names): the gradient of the tie, through any of its names."""
        self._handle()                   # (closed: said before anything is imported)
        g = self._import_grad(name, grad)
        try:
            self._set_grad(name, grad, g)
        except BaseException:
            if g is not None:
                _lib.ms_tensor_free(g)
            raise
        self._remember_grad(self._tie[name], g)

    @_locked
    def step(self, grads=None, grad_scale=None):
        """One step.  grads: {name: gradient} for this step only: afterwards (and after a refused step) each
        parameter has the gradient it had before, except inside a CUDA graph capture of the context's stream,
        whose replays read them (tied names must not be given different gradients: a tie has one).  grad_scale:
        the gradients are this many times too large (they are divided in place; None or 0: not scaled).
        Returns True when the step was applied, False when it was skipped (NaN/Inf gradients), None when the
        device decides (captured steps, settings["device_checks"])."""
        self._handle()
        opts = _StepOptions(_grad_scale(grad_scale, "step"))
        if grads is not None and not isinstance(grads, dict):
            raise TypeError("step: grads must be a dict {name: gradient} (got %s)" % type(grads).__name__)
        handles, given = {}, {}    # name -> its imported gradient; tie -> (a name of it, the gradient it had)
        capturing, kept = False, set()   # (the handles a captured step keeps as the registered gradients)
        try:
            for name, grad in (grads or {}).items():
                if name not in self._keep:
                    raise MoonstepError("MS_E_ARG", "step: grads: no parameter named %r" % (name,))
                handles[name] = self._import_grad(name, grad)     # (None: none this step)
            views = {}             # tie -> (name, view of its gradient): two different ones are refused
            for name, g in handles.items():
                tie, view = self._tie[name], _view(g) if g is not None else None
                if tie in views and views[tie][1] != view:
                    raise MoonstepError("MS_E_ARG", "step: grads: parameters %r and %r are tied (one tensor) but were "
                                        "given different gradients: a tie has one gradient" % (views[tie][0], name))
                views[tie] = (name, view)
            for name, g in handles.items():
                tie = self._tie[name]
                if tie not in given:
                    given[tie] = (name, self._keep[name][1])
                self._set_grad(name, grads[name], g)
            applied = ctypes.c_int(0)
            capturing = self.context.is_cuda and _lib.ms_ctx_is_capturing(self.context._handle()) != 0
            _check(self._ordered(_lib.ms_optimizer_step_with, self._handle(), ctypes.byref(opts),
                                 ctypes.byref(applied)))
            if capturing:          # the replays read this step's gradients: they stay, as the registered ones
                for name, g in handles.items():
                    if g is None or g.value not in kept:
                        self._remember_grad(self._tie[name], g)
                        if g is not None:
                            kept.add(g.value)
        except Exception:
            for name, before in given.values():
                self._restore_grad(name, before)
            raise
        finally:
            for g in handles.values():
                if g is not None and not (capturing and g.value in kept):
                    _lib.ms_tensor_free(g)
        if not capturing:          # this step's gradients only: the registered ones are back
            for name, before in given.values():
                self._restore_grad(name, before)
        return None if applied.value < 0 else bool(applied.value)

    @property
    @_locked
    def lr(self):
        """The learning rate of the next step; setting it replaces the schedule."""
        out = ctypes.c_double()
        _check(_lib.ms_optimizer_get_lr(self._handle(), ctypes.byref(out)))
        return out.value

    @lr.setter
    @_locked
    def lr(self, value):
        _check(_lib.ms_optimizer_set_lr(self._handle(), _number(value, "lr")))

    @_locked
    def save(self, path):
        _check(self._ordered(_lib.ms_optimizer_save, self._handle(), _path(path, "path")))

    @_locked
    def load(self, path):
        _check(self._ordered(_lib.ms_optimizer_load, self._handle(), _path(path, "path")))

    @_locked
    def _json(self, fn):
        out = ctypes.c_void_p()
        _check(self._ordered(fn, self._handle(), ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            _lib.ms_string_free(out)

    def info(self):
        """Routes, groups and state bytes per parameter (a dict)."""
        return self._json(_lib.ms_optimizer_info)

    def stats(self):
        """Step count, skipped steps, lr and the last step's numbers (a dict)."""
        return self._json(_lib.ms_optimizer_stats)

    @_locked
    def capture(self):
        """Captures the step into CUDA graphs that later steps replay (CUDA contexts)."""
        _check(_lib.ms_optimizer_capture(self._handle()))

    @_locked
    def prepare_replay(self, grad_scale=None):
        """Before each replay of a CUDA graph of the caller's (torch.cuda.graph, a CuPy graph) that recorded
        step(): writes this replay's learning rate and step number where the recorded step reads them, and
        counts the step, as an uncaptured step() would.  grad_scale: this replay's, exactly when the recorded
        step was given one.  Ordered after the framework's current stream and before its later work, like
        step().  Recording needs settings["device_checks"] and one uncaptured step first (moonstep.h, "Inside a
        trainer's CUDA graph")."""
        opts = _StepOptions(_grad_scale(grad_scale, "prepare_replay"))
        _check(self._ordered(_lib.ms_optimizer_prepare_replay_with, self._handle(), ctypes.byref(opts)))

    # --- state dicts -------------------------------------------------------------------------------
    def _one_file(self, what):
        if self._comm is not None and self._comm.world_size > 1:
            raise MoonstepError("MS_E_ARG", "%s: an optimizer of %d ranks checkpoints into one file per rank: use "
                                "save(path) and load(path) with a path every rank reaches (it loads on another "
                                "number of ranks too)" % (what, self._comm.world_size))

    @_locked
    def checkpoint_bytes(self):
        """The optimizer's checkpoint (what save() writes) as bytes (one rank)."""
        self._one_file("checkpoint_bytes")
        with tempfile.TemporaryDirectory(prefix="moonstep-") as d:
            path = os.path.join(d, "optim.safetensors")
            self.save(path)
            with open(path, "rb") as f:
                return f.read()

    @_locked
    def load_checkpoint_bytes(self, data):
        """Loads a checkpoint_bytes() (bytes, bytearray, memoryview or another bytes-like object)."""
        try:
            data = memoryview(data).tobytes()  # (bytes() of an int would be that many zero bytes)
        except TypeError:
            raise TypeError("load_checkpoint_bytes: data must be bytes-like (bytes, bytearray, memoryview; got %s)"
                            % type(data).__name__) from None
        self._one_file("load_checkpoint_bytes")
        with tempfile.TemporaryDirectory(prefix="moonstep-") as d:
            path = os.path.join(d, "optim.safetensors")
            with open(path, "wb") as f:
                f.write(data)
            self.load(path)

    def state_dict(self):
        return {"moonstep": self.checkpoint_bytes(), "param_names": list(self.names)}

    def load_state_dict(self, state):
        """Restores state_dict() output, or a torch.optim.AdamW (or Adam) state dict (see load_adamw_state)."""
        if "moonstep" in state:
            self.load_checkpoint_bytes(state["moonstep"])
        elif "state" in state and "param_groups" in state:
            self.load_adamw_state(state)
        else:
            raise ValueError("not a moonstep or torch.optim.AdamW state dict (no 'moonstep', no 'state')")

    def load_adamw_state(self, state, names=None):
        """Moves a torch.optim.AdamW (or Adam) state dict into this optimizer: for each parameter the recipe
        routes to AdamW, exp_avg and exp_avg_sq become moonstep's moments of the same names, and the step count
        (one for all) moonstep's.  Parameters are matched by the state dict's param_names when it has them,
        else by position (names: this optimizer's names in the torch optimizer's order; default self.names).
        Others keep their state.  Returns {"loaded": [...], "kept": [...]} (parameter names)."""
        groups = state["param_groups"]
        index_to_name = {}
        order = [i for g in groups for i in g["params"]]
        if all("param_names" in g for g in groups):
            for g in groups:
                index_to_name.update(zip(g["params"], g["param_names"]))
        else:
            names = list(names if names is not None else self.names)
            if len(order) != len(names):
                raise ValueError("the state dict has %d parameters, this optimizer %d: pass names=" % (len(order), len(names)))
            index_to_name.update(zip(order, names))
        tensors, meta = _read_safetensors(self.checkpoint_bytes())
        info = json.loads(meta["moonstep"])
        options = info.get("options", {})
        for g in groups:
            for key in ("betas", "eps"):
                if key in g and key in options and _as_list(g[key]) != _as_list(options[key]):
                    warnings.warn("moonstep: the torch optimizer's %s=%r differs from this optimizer's %r"
                                  % (key, g[key], options[key]))
        loaded, steps = [], set()
        for index, st in state["state"].items():
            name = index_to_name.get(index)
            if name is None:
                raise ValueError("state for parameter index %r, which the param_groups do not list" % (index,))
            if name not in self.names:
                raise ValueError("parameter %r of the state dict is not in this optimizer" % name)
            if "exp_avg" not in st or "exp_avg_sq" not in st:
                continue
            key_m, key_v = "param/%s/exp_avg" % name, "param/%s/exp_avg_sq" % name
            if key_m not in tensors or key_v not in tensors:
                continue                          # routed to something other than AdamW: its state stays
            for key, value in ((key_m, st["exp_avg"]), (key_v, st["exp_avg_sq"])):
                dtype, shape, _ = tensors[key]
                if dtype not in ("F32", "BF16"):
                    raise ValueError("parameter %r: moonstep keeps its AdamW moments as %s (8-bit); create the optimizer "
                                     "with 32-bit moments (e.g. sinkgd's adamw_state='f32') to load a torch state" % (name, dtype))
                values = _host_array(value)
                if list(values.shape) != list(shape):
                    raise ValueError("parameter %r: %s has shape %s in the state dict, %s here"
                                     % (name, key.rsplit("/", 1)[1], list(values.shape), shape))
                tensors[key][2] = _encode(values, dtype)
            step = st.get("step", 0)
            steps.add(int(step.item() if hasattr(step, "item") else step))
            loaded.append(name)
        if len(steps) > 1:
            raise ValueError("the parameters were at different steps %s; moonstep keeps one step count" % sorted(steps))
        if steps:
            info["step"] = steps.pop()
        meta["moonstep"] = json.dumps(info)
        self.load_checkpoint_bytes(_write_safetensors(tensors, meta))
        return {"loaded": loaded, "kept": [n for n in self.names if n not in loaded]}

    # --- lifetime ----------------------------------------------------------------------------------
    def close(self):
        """Frees the optimizer (its state and its Lua state); the parameters stay.  Safe from another thread than
        one using the optimizer: that one's calls then raise ValueError ("the optimizer is closed")."""
        with _lock_of(self):       # waits for a call in progress; the handles are detached before they are freed
            h, self._opt = getattr(self, "_opt", None), None
            grads, self._grad_handles = getattr(self, "_grad_handles", {}), {}
            self._keep = {}
            if h and _lib is not None:
                _lib.ms_optimizer_free(h)
            for g in grads.values():
                if _lib is not None:
                    _lib.ms_tensor_free(g)
            self._comm = None      # the communicator may go now

    __del__ = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------
# torch.optim.Optimizer
# ---------------------------------------------------------------------------------------------------
def _make_torch_optimizer():
    import torch

    class TorchOptimizer(torch.optim.Optimizer):
        """A torch.optim.Optimizer running a moonstep recipe on the parameters, in place (DLPack, no copies), on
        torch's current stream.

            opt = moonstep.TorchOptimizer(model.named_parameters(), "sinkgd", lr=1e-3, options={...})
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
            loss.backward(); opt.step(); opt.zero_grad(); sched.step()

        params: model.named_parameters() (names reach the recipe's routing and the checkpoints), tensors
        (named "0", "1", ...), or param groups {"params": [...], "weight_decay": 0} (such a group's parameters
        are tagged "no_decay", which every built-in recipe honours: no weight decay on any route) with an
        optional "tags" list.  Frozen parameters (requires_grad=False) are left out: they get no state, and a
        step that finds a gradient on one is refused (make the optimizer after unfreezing it).  param_groups[0]["lr"] is the learning rate of
        every step (torch LR schedulers set it); the settings take no "schedule".

        capturable=True (settings["device_checks"]: the non-finite check on the device, no host sync per step)
        lets step() be recorded inside torch.cuda.graph after one uncaptured step; call prepare_replay() before
        each replay of that graph:

            opt = moonstep.TorchOptimizer(model.named_parameters(), "adamw", lr=1e-3, capturable=True)
            ... warm-up steps on a side stream, as torch's CUDA graph notes show ...
            opt.zero_grad(set_to_none=True)
            with torch.cuda.graph(g):
                loss = loss_fn(model(static_x), static_y); loss.backward(); opt.step()
            for x, y in data:
                static_x.copy_(x); static_y.copy_(y)
                opt.prepare_replay()          # this replay's lr (param_groups[0]["lr"]) and step number
                g.replay()
                sched.step()

        Several ranks (torchrun; README, "Multi-GPU"): comm, a moonstep.Comm of this process's rank; shards,
        {param or name: ("rows" | "cols", offset, global size of that dim)} for the parameters of which this rank
        holds a slice (FSDP-style rows, tensor-parallel columns), p.grad being the slice's gradient; distribute,
        "owner" (the default with several ranks: each unsharded parameter updated on one rank, then broadcast)
        or "replicate" (every rank updates every parameter; their gradients must be identical, as after DDP's
        all-reduce):

            id = moonstep.comm_unique_id() if rank == 0 else None
            box = [id]; torch.distributed.broadcast_object_list(box, src=0)
            comm = moonstep.Comm(rank, world_size, box[0], device="cuda:%d" % local_rank)
            opt = moonstep.TorchOptimizer(params, "sinkgd", lr=1e-3, comm=comm, shards={w: ("rows", r0, m)})
        """

        def __init__(self, params, recipe="adamw", lr=1e-3, options=None, settings=None, capturable=False,
                     comm=None, shards=None, distribute=None):
            given, tags = self._named(params)
            shard_of = self._shards(given, shards)
            # frozen parameters (requires_grad=False: a LoRA run's base weights) get no state, as axolotl leaves
            # them out and torch makes none before a gradient: the recipes allocate state at creation (8-bit
            # moments of an 8B model's embeddings are gigabytes)
            named = [(n, p) for n, p in given if p.requires_grad]
            self._given_names = [n for n, _ in given]   # (a torch optimizer's state dict counts the frozen too)
            self._frozen = [(n, p) for n, p in given if not p.requires_grad]
            if not named:
                raise ValueError("no trainable parameters: every one given has requires_grad=False")
            if distribute is not None:
                if settings and "distribute" in settings and settings["distribute"] != distribute:
                    raise ValueError("distribute=%r and settings['distribute']=%r disagree"
                                     % (distribute, settings["distribute"]))
                settings = dict(settings or {}, distribute=distribute)
            options = dict(options or {})
            if "lr" in options and options["lr"] != lr:
                raise ValueError("give the learning rate as lr=, not in options")
            options["lr"] = lr
            if settings and "schedule" in settings:
                raise ValueError("a TorchOptimizer's learning rate is param_groups[0]['lr']: use a torch LR scheduler")
            if capturable:
                if settings and settings.get("device_checks") is False:
                    raise ValueError("capturable=True needs settings['device_checks']: captured steps check the "
                                     "gradients on the device")
                settings = dict(settings or {}, device_checks=True)
            self._capturable = bool(capturable or (settings or {}).get("device_checks"))
            self._building = True
            super().__init__([p for _, p in named], {"lr": lr})
            self._building = False
            self.param_names = [n for n, _ in named]
            self.moonstep = Optimizer([(n, p, p.grad, tags.get(n), shard_of.get(n)) for n, p in named], recipe,
                                      options, settings, comm=comm)
            self._grad_keys = {n: self._grad_key(p.grad) for n, p in named}
            self._pushed_lr = lr

        @staticmethod
        def _named(params):
            named, tags = [], {}

            def add(item, group_tags):
                name, p = item if isinstance(item, (tuple, list)) else (str(len(named)), item)
                named.append((name, p))
                if group_tags:
                    tags[name] = group_tags

            for item in list(params):
                if not isinstance(item, dict):
                    add(item, None)
                    continue
                extra = set(item) - {"params", "weight_decay", "tags"}
                if extra:
                    raise ValueError("param group keys %s: moonstep takes a per-group weight_decay=0 and tags only "
                                     "(the recipe's options apply to every parameter)" % sorted(extra))
                group_tags = list(item.get("tags", []))
                if "weight_decay" in item:
                    if item["weight_decay"] != 0:
                        raise ValueError("a param group's weight_decay must be 0 (its parameters are tagged no_decay)")
                    group_tags.append("no_decay")
                for sub in list(item["params"]):
                    add(sub, group_tags)
            return named, tags

        @staticmethod
        def _shards(named, shards):
            """{name: shard} from {param tensor or name: (dim, offset, size)}; keys must be parameters here."""
            if not shards:
                return {}
            by_id = {id(p): n for n, p in named}
            names = set(by_id.values())
            out = {}
            for key, spec in shards.items():
                name = key if isinstance(key, str) else by_id.get(id(key))
                if name not in names:
                    raise ValueError("shards: %s is not one of the optimizer's parameters"
                                     % (repr(key) if isinstance(key, str) else "a tensor of shape %s" % list(key.shape)))
                out[name] = spec
            return out

        @staticmethod
        def _grad_key(g):
            return None if g is None else (g.data_ptr(), tuple(g.shape), g.dtype, g.device)

        def add_param_group(self, group):
            if not getattr(self, "_building", False):
                raise NotImplementedError("moonstep's parameters are fixed once the optimizer is made")
            super().add_param_group(group)

        def _push_lr(self):
            lr = self.param_groups[0]["lr"]
            if lr != self._pushed_lr:
                self.moonstep.lr = lr
                self._pushed_lr = lr

        @torch.no_grad()
        def step(self, closure=None):
            """One step on the parameters' current gradients; inside torch.cuda.graph it is recorded into the
            graph (capturable=True, after one uncaptured step), and prepare_replay() readies each replay."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if not self._capturable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise MoonstepError("MS_E_UNSUPPORTED", "step() inside torch.cuda.graph needs "
                                    "TorchOptimizer(..., capturable=True) and one uncaptured step() first")
            self._push_lr()
            for name, p in self._frozen:
                if p.grad is not None:
                    raise MoonstepError("MS_E_ARG", "step: parameter %r has a gradient, but it was frozen "
                                        "(requires_grad=False) when the optimizer was made and has no state: make the "
                                        "optimizer after unfreezing it" % (name,))
            for name, p in zip(self.param_names, self.param_groups[0]["params"]):
                key = self._grad_key(p.grad)
                if key != self._grad_keys[name]:          # a new gradient tensor (zero_grad set it to None)
                    self.moonstep.set_grad(name, p.grad)
                    self._grad_keys[name] = key
            self.moonstep.step()
            return loss

        def prepare_replay(self):
            """Before each g.replay() of a torch.cuda.graph that recorded step(): this replay's learning rate
            (param_groups[0]["lr"], as a scheduler left it) and step number go where the recorded step reads
            them, and the step is counted, as an uncaptured step() would.  Call it outside the capture, once per
            replay, in the replays' order; it is ordered after torch's current stream and before its later
            work, like step()."""
            self._push_lr()
            self.moonstep.prepare_replay()

        def state_dict(self):
            group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
            group["params"] = list(range(len(self.param_names)))
            group["param_names"] = list(self.param_names)
            return {"state": {}, "param_groups": [group], "moonstep": self.moonstep.checkpoint_bytes()}

        def load_state_dict(self, state_dict):
            """A state_dict() of a TorchOptimizer, or of torch.optim.AdamW / Adam over the same parameters (in
            the same order, or named through param_names) for the parameters routed to AdamW."""
            if "moonstep" in state_dict:
                self.moonstep.load_checkpoint_bytes(state_dict["moonstep"])
                report = None
            else:
                report = self.moonstep.load_adamw_state(state_dict, names=self._given_names)
            for key, value in state_dict["param_groups"][0].items():
                if key not in ("params", "param_names"):
                    self.param_groups[0][key] = value
            self._pushed_lr = None        # the next step sets the group's lr
            return report

    return TorchOptimizer


def __getattr__(name):
    if name == "TorchOptimizer":
        cls = _make_torch_optimizer()
        globals()[name] = cls
        return cls
    raise AttributeError("module 'moonstep' has no attribute %r" % name)
