"""The PyTorch model, loaded from the GGUF, against Hugging Face transformers' own GGUF loader."""

import functools
import os

import torch

from common.model.llama import Batch, KVCache, LlamaModel


def test_logits_match_transformers(checkpoint, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers' GGUF loader builds gguf's tensor-name map anew for each module it visits (397 times: 9 of the 20 s
    # it takes on the 2-core machine); the map is a function of its arguments alone, so a cache changes nothing else
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))

    cfg = checkpoint.config
    model = LlamaModel(cfg)
    model.load_state_dict(checkpoint.state_dict, strict=False)
    model.eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]])
    t = ids.shape[1]
    cache = KVCache.allocate(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    pos = torch.arange(t)[None]
    batch = Batch.masked(
        input_ids=ids,
        positions=pos,
        slots=torch.tensor([1]),
        write_pos=pos,
        mask=torch.ones(t, t, dtype=torch.bool).tril()[None, None],
    )
    with torch.no_grad():
        ours = model.logits(model(batch, cache).hidden)
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(checkpoint.path), gguf_file=checkpoint.path.name, dtype=torch.float32
        )
        ref = hf(ids).logits
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
