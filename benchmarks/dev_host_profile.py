"""Where a small call's host time goes (issue 12; the forward, the backward, the linear forward and, for issue 15, a
decode step: attention_with_kvcache at B=1, Hq=32, Hk=8, cache 4096, D=128), by parts and by cProfile. GPU machine:
    python benchmarks/dev_host_profile.py
"""
import cProfile, pstats, io, sys, time, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy, numpy as np
import cupyflash
from cupyflash import cuda_backend as cb
from cupyflash.kernels import family

def per_call(f, n=3000):
    for _ in range(50): f()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t) / n * 1e6

rng = cupy.random.default_rng(0)
bf16 = cupy.dtype('bfloat16')
q, k, v = (rng.standard_normal((1, 8, 128, 64), dtype=np.float32).astype(bf16) for _ in range(3))
o, lse = cupyflash.attention_forward(q, k, v)
do = rng.standard_normal(o.shape, dtype=np.float32).astype(bf16)
rows = {}
rows['api forward'] = per_call(lambda: cupyflash.attention_forward(q, k, v))
rows['plain_forward (short path)'] = per_call(lambda: cb.plain_forward(q, k, v, False, None))
rows['cuda_backend.forward (full)'] = per_call(lambda: cb.forward(q, k, v, False, None, 'auto'))
fprep = next(iter(cb._forward_cache.values()))
rows['forward outputs'] = per_call(lambda: cb._empty_outputs(fprep.outputs))
fl = fprep.plan.ready()
rows['forward fire only'] = per_call(lambda: [l.fire(cupy.cuda.get_current_stream().ptr) for l in fl])
rows['api backward'] = per_call(lambda: cupyflash.attention_backward(do, q, k, v, o, lse))
rows['plain_backward (short path)'] = per_call(lambda: cb.plain_backward(do, q, k, v, o, lse, False, None))
rows['cuda_backend.backward (full)'] = per_call(lambda: cb.backward(do, q, k, v, o, lse, False, None, 'auto'))
prep = next(iter(cb._backward_cache.values()))
dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
ptrs = {"dout": do.data.ptr, "q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": o.data.ptr, "lse": lse.data.ptr,
        "dq": dq.data.ptr, "dk": dk.data.ptr, "dv": dv.data.ptr}
rows['family.run only'] = per_call(lambda: family.run(prep.plan, prep.geometry, ptrs))
values = tuple(ptrs[n] for n in prep.run.names)
rows['prepared runner only'] = per_call(lambda: prep.run(values))
launches = prep.plan.ready()
st = cupy.cuda.get_current_stream().ptr
rows['fire x%d only' % len(launches)] = per_call(lambda: [l.fire(st) for l in launches])
rows['cupy.empty x3'] = per_call(lambda: (cupy.empty(q.shape, bf16), cupy.empty(k.shape, bf16), cupy.empty(v.shape, bf16)))
rows['cupy.cuda.alloc'] = per_call(lambda: cupy.cuda.alloc(1 << 16))
rows['memsetAsync'] = per_call(lambda: cupy.cuda.runtime.memsetAsync(dq.data.ptr, 0, 1 << 16, st))
bptrs = lambda: (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr)
rows['backward signature'] = per_call(lambda: cb._backward_signature(q, k, v, o, lse, do, bptrs(), False, None,
                                                                     cb._device()))
print('backward launches:', [l.name if hasattr(l, 'name') else type(l).__name__ for l in launches], 'scratch', prep.plan.scratch)
for k_, v_ in rows.items(): print(f"{k_:28s} {v_:8.2f} us")
from cupyflash import linear_attention_forward
qc = rng.standard_normal((1, 32, 1, 128), dtype=np.float32).astype(bf16)
kc, vc = (rng.standard_normal((1, 8, 4096, 128), dtype=np.float32).astype(bf16) for _ in range(2))
lens = cupy.full((1,), 4096, dtype=cupy.int32)
decode = lambda: cupyflash.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens)
from cupyflash.kernels import linear as lin
rows2 = {'linear fwd causal': per_call(lambda: linear_attention_forward(q, k, v, causal=True)),
         'linear plain_forward': per_call(lambda: lin.plain_forward(q, k, v, True, 1.0)),
         'decode B=1 cache 4096': per_call(decode)}
for k_, v_ in rows2.items(): print(f"{k_:28s} {v_:8.2f} us")
for label, f in (("forward", lambda: cupyflash.attention_forward(q, k, v)),
                 ("backward", lambda: cupyflash.attention_backward(do, q, k, v, o, lse)),
                 ("linear", lambda: linear_attention_forward(q, k, v, causal=True)),
                 ("decode", decode)):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(3000): f()
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(22); print(label, s.getvalue()[-4500:])
