"""Speculative rollback of Gated DeltaNet states on the CPU: per-position verify slots vs replay.

One linear layer's recurrent state [value heads, dk, dv] fp32 is advanced over k + 1 verify tokens
(S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q). Then a of them are accepted:
- slots:  the pass stores the state after every token into its own slot; accepting a selects slot a
          (the cost is the k + 1 stores, the accept itself is an index);
- replay: the pass stores nothing; accepting a re-runs the a + 1 kept updates from the saved state.
Prints the median time of each part; the numbers and the decision are in docs/state-cache.md.

    python tools/bench_state_rollback.py [--heads 16] [--dim 128] [--drafts 3] [--repeats 50]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def update(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, beta: np.ndarray, g: np.ndarray) -> np.ndarray:
    """One Gated DeltaNet token, all value heads, in place; returns o [heads, dv]."""
    state *= np.exp(g)[:, None, None]
    delta = beta[:, None] * (v - np.einsum("hkv,hk->hv", state, k))
    state += k[:, :, None] * delta[:, None, :]
    return np.einsum("hkv,hk->hv", state, q)


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    h, d, n = args.heads, args.dim, args.drafts + 1
    base = rng.standard_normal((h, d, d)).astype(np.float32) * 0.1
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, 1, (n, h)).astype(np.float32)
    g = -rng.uniform(0, 0.1, (n, h)).astype(np.float32)
    slots = np.empty((n, h, d, d), np.float32)
    state = base.copy()

    def plain_pass() -> None:
        np.copyto(state, base)
        for t in range(n):
            update(state, q[t], k[t], v[t], beta[t], g[t])

    def pass_with_slots() -> None:
        np.copyto(state, base)
        for t in range(n):
            update(state, q[t], k[t], v[t], beta[t], g[t])
            np.copyto(slots[t], state)

    def replay(accepted: int) -> None:
        np.copyto(state, base)
        for t in range(accepted + 1):
            update(state, q[t], k[t], v[t], beta[t], g[t])

    plain = median_ms(plain_pass, args.repeats)
    with_slots = median_ms(pass_with_slots, args.repeats)
    copy_one = median_ms(lambda: np.copyto(slots[0], state), args.repeats)
    print(f"state [{h}, {d}, {d}] fp32 = {base.nbytes / 2**20:.2f} MiB, k + 1 = {n} verify tokens")
    print(f"verify pass, no stores          {plain:8.3f} ms")
    print(f"verify pass, a slot per token   {with_slots:8.3f} ms  (+{with_slots - plain:.3f} ms for {n} stores; accept = index)")
    print(f"one state copy                  {copy_one:8.3f} ms")
    for accepted in range(n):
        print(f"replay of {accepted + 1} kept updates        {median_ms(lambda a=accepted: replay(a), args.repeats):8.3f} ms")
    replayed = state.copy()
    pass_with_slots()
    print(f"replay == slot (all accepted): {np.array_equal(replayed, slots[n - 1])}")


if __name__ == "__main__":
    main()
