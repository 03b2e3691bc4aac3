"""Engine 5 bring-up, step 2: parameter passing and one TMA box.   PYTHONPATH=. python dev/debug_wgmma2.py"""
import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

try:
    from pycuda._pvt_struct import calcsize
    print("calcsize('128s128sPPPiiiiiiiffi') =", calcsize("128s128sPPPiiiiiiiffi"), "(expect 320)")
except Exception as e:
    print("calcsize failed:", e)
rt = Runtime()
D = {"GEMM_WGMMA_DEBUG": 1}
A = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)
dA = rt.to_device(A)
tm = gw.tensor_map(dA.ptr, "tf32", 128, 32, 32, 128)
print("tensor map words:", np.frombuffer(tm, np.uint32)[:8] & 0xFFFF)
k = rt.kernel("gemm_wgmma", "wgmma_debug_params", "128s128sPPPiiiiiiiffi", defines=D)
C = rt.empty((64,), np.float32)
C.fill_bytes(0)
k((1, 1, 1), (32, 1, 1), tm, tm, C.ptr, 0x1234, 0, np.int32(11), np.int32(22), np.int32(33), np.int32(44),
  np.int32(55), np.int32(66), np.int32(77), np.float32(1.5), np.float32(2.5), np.int32(9))
print("params seen:", C.get()[:24])
k2 = rt.kernel("gemm_wgmma", "wgmma_debug_tma", "128sPi", defines=D)
k2.set_max_dynamic_smem(16384 + 1024)
out = rt.empty((128 * 32,), np.float32)
out.fill_bytes(0xFF)
k2((1, 1, 1), (128, 1, 1), tm, out.ptr, np.int32(128), smem=16384 + 1024)
o = out.get().reshape(128, 32)
print("TMA box: NaN", int(np.isnan(o).sum()), "row0", o[0, :8], "row1", o[1, :8])
# unswizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8)
un = np.empty_like(o)
for r in range(128):
    for c in range(8):
        un[r, 4 * c:4 * c + 4] = o[r, 4 * (c ^ (r % 8)):4 * (c ^ (r % 8)) + 4]
print("unswizzled equals A:", np.array_equal(un, A))
