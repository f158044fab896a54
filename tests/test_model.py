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
    model = LlamaModel.loaded(cfg, checkpoint.state_dict, torch.device("cpu"), torch.float32)
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


def test_a_gguf_checkpoint_is_cached_and_a_bad_cache_is_read_past(checkpoint, tmp_path, monkeypatch, caplog):
    """The first load of a GGUF file writes its float32 weights to the cache, the next reads them from there (equal
    to the bit, max_position applied), a damaged cache is logged and read past, and the key follows the file's
    mtime. The parse itself is the session checkpoint's (tests/conftest.py), so this test does not pay for one."""
    import dataclasses
    import logging
    import os

    from common import weights

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parses = []
    monkeypatch.setattr(weights, "_read_gguf", lambda path: parses.append(path) or checkpoint)
    path = weights.default_model_path()
    cached = weights.gguf_cache_file(path)
    assert cached.parent == tmp_path / "cache" / "specdec" / "checkpoints"
    weights.load_checkpoint()
    assert len(parses) == 1 and cached.is_file() and cached.with_suffix(".json").is_file()
    with caplog.at_level(logging.INFO, logger="common.weights"):
        again = weights.load_checkpoint(max_position=512)
    assert len(parses) == 1 and "cached from" in caplog.text
    assert again.config == dataclasses.replace(checkpoint.config, max_position=512) and again.name == checkpoint.name
    assert again.state_dict.keys() == checkpoint.state_dict.keys()
    assert all(torch.equal(again.state_dict[k], v) for k, v in checkpoint.state_dict.items())
    cached.write_bytes(b"not a safetensors file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="common.weights"):
        weights.load_checkpoint()
    assert len(parses) == 2 and "unreadable" in caplog.text
    other = tmp_path / "model.gguf"
    other.write_bytes(b"x")
    before = weights.gguf_cache_file(other)
    os.utime(other, ns=(1, 1))
    assert weights.gguf_cache_file(other) != before
