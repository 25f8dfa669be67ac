"""numpy (OpenBLAS) float32 GFLOP/s on the layer shapes of W1, the same cases as `lbbsp bench gemm`
(src/bench.rs, gemm_cases) after square-2048, which ../shared/peers/run numpy-gemm measures.
Each timed sample repeats the product for at least 20 ms; prints the median and best of REPS samples.
Run with the peers' numpy venv: scripts/bench_peers.sh does."""
import sys, time
import numpy as np

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
# name, op(A) transposed, op(B) transposed, m, n, k  (C = op(A) op(B), op(A) m x k, op(B) k x n)
cases = [
    ("fc1-fwd", False, True, 128, 512, 784),
    ("fc1-dw", True, False, 512, 784, 128),
    ("fc1-dx", False, False, 128, 784, 512),
    ("fc2-fwd", False, True, 128, 256, 512),
    ("fc2-dw", True, False, 256, 512, 128),
    ("fc2-dx", False, False, 128, 512, 256),
]
rng = np.random.default_rng(0)
for name, ta, tb, m, n, k in cases:
    a = rng.random((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.random((n, k) if tb else (k, n), dtype=np.float32)
    opa, opb = (a.T if ta else a), (b.T if tb else b)  # views: OpenBLAS gets the transpose flags
    c = np.empty((m, n), dtype=np.float32)

    def run(times):
        t = time.perf_counter()
        for _ in range(times):
            np.matmul(opa, opb, out=c)
        return time.perf_counter() - t

    once = run(3) / 3
    inner = max(1, int(np.ceil(0.02 / max(once, 1e-9))))
    rates = sorted(2.0 * m * n * k * inner / run(inner) / 1e9 for _ in range(reps))
    print(f"RESULT gemm=numpy shape={name} m={m} n={n} k={k} gflops_median={rates[len(rates) // 2]:.1f} "
          f"gflops_best={rates[-1]:.1f}", flush=True)
