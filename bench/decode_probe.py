"""GPU probe (not run in CI, not yet run on a GPU): CUDA kernels per decode step (torch.profiler) and CUDA
graph replay time of LlamaModel at SmolLM2-135M shape with random weights, batch 1, one token.
    PYTHONPATH=. python bench/decode_probe.py [-v]     (-v lists the kernels by name)
"""

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from common.config import LlamaConfig
from common.model.llama import Batch, KVCache, LlamaModel

CFG = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_eps=1e-5, max_position=8192,
                  tie_embeddings=True)


def probe(dtype: torch.dtype, kv_len: int = 1024, steps: int = 200) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    m = LlamaModel(CFG).to(dev, dtype).eval()
    m.fuse()
    cache = KVCache.allocate(CFG.num_layers, 2, 2048, CFG.num_kv_heads, CFG.head_dim, dtype, dev)
    pos = torch.tensor([[100]], device=dev)
    batch = Batch(input_ids=torch.tensor([[5]], device=dev), positions=pos, slots=torch.tensor([1], device=dev),
                  write_pos=pos, mask=(torch.arange(kv_len, device=dev) <= 100)[None, None, None, :])

    def body() -> torch.Tensor:
        return m.logits(m(batch, cache).hidden[:, -1]).argmax(-1)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body()
        torch.cuda.current_stream().wait_stream(side)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            body()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"{dtype} kv_len={kv_len}: {len(kernels)} kernels/step ({len(kernels) / CFG.num_layers:.1f} per layer "
          f"incl. fixed), graph replay {ms:.3f} ms/step")
    if "-v" in sys.argv:
        for name, n in collections.Counter(e.name[:100] for e in kernels).most_common():
            print(f"  {n:5d} {name}")


if __name__ == "__main__":
    for dt in (torch.bfloat16, torch.float32):
        probe(dt)
