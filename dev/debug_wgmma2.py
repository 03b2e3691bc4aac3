"""Engine 5 bring-up, step 2: one TMA box through shared memory.   PYTHONPATH=. python dev/debug_wgmma2.py"""
import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

rt = Runtime()
A = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)
dA = rt.to_device(A)
dtm = rt.to_device(np.frombuffer(gw.tensor_map(dA.ptr, "tf32", 128, 32, 32, 128), np.uint8))
k = rt.kernel("gemm_wgmma", "wgmma_debug_tma", "PPi", defines={"GEMM_WGMMA_DEBUG": 1})
k.set_max_dynamic_smem(16384 + 1024)
out = rt.empty((128 * 32,), np.float32)
out.fill_bytes(0xFF)
k((1, 1, 1), (128, 1, 1), dtm.ptr, out.ptr, np.int32(128), smem=16384 + 1024)
o = out.get().reshape(128, 32)
print("TMA box: NaN", int(np.isnan(o).sum()), "row0", o[0, :8], "row1", o[1, :8])
un = np.empty_like(o)  # unswizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8)
for r in range(128):
    for c in range(8):
        un[r, 4 * c:4 * c + 4] = o[r, 4 * (c ^ (r % 8)):4 * (c ^ (r % 8)) + 4]
print("unswizzled equals A:", np.array_equal(un, A))
