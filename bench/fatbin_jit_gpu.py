"""Load every fatbin a scfoundry binary embeds through the CUDA driver alone (ctypes on
libcuda: no cuBLAS), once as the driver picks (machine code for the card) and once with
CUDA_FORCE_PTX_JIT=1 in a child process (the PTX compiled by the driver at load, as a card newer
than the build's machine code would): does each module load, and how long does the JIT take.
The fatbins are found by cuda/list_fatbins.py's `fatbins`.

    python3 bench/fatbin_jit_gpu.py BINARY          # on a GPU machine; numpy not needed
"""
import ctypes
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cuda"))
from list_fatbins import fatbins  # noqa: E402  (the fatbins cut out by their header, one finder)


def load_all(binary):
    cuda = ctypes.CDLL("libcuda.so.1")
    def ok(r, what):
        if r != 0:
            s = ctypes.c_char_p()
            cuda.cuGetErrorString(r, ctypes.byref(s))
            return f"{what}: error {r} {s.value.decode() if s.value else ''}"
        return None
    assert cuda.cuInit(0) == 0
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    data = open(binary, "rb").read()
    loaded = failed = 0
    t0 = time.perf_counter()
    for n, (offset, fb) in enumerate(fatbins(data)):
        mod = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(fb, len(fb))
        err = ok(cuda.cuModuleLoadData(ctypes.byref(mod), buf), f"fatbin {n} at 0x{offset:x}")
        if err:
            failed += 1
            print("  " + err)
        else:
            loaded += 1
            cuda.cuModuleUnload(mod)
    jit = os.environ.get("CUDA_FORCE_PTX_JIT", "0")
    print(f"CUDA_FORCE_PTX_JIT={jit}: {loaded} fatbins loaded, {failed} failed, {time.perf_counter() - t0:.1f} s")
    return failed


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--child":
        sys.exit(1 if load_all(sys.argv[1]) else 0)
    rc = 0
    for jit in ("0", "1"):
        env = dict(os.environ, CUDA_FORCE_PTX_JIT=jit)
        rc |= subprocess.run([sys.executable, __file__, sys.argv[1], "--child"], env=env).returncode
    sys.exit(rc)
