"""locret.hf_gguf: transformers' reading of a GGUF, kept. Loaded from the cache, the model and tokenizer must be the
ones transformers builds from the GGUF itself (weights, logits, token ids all equal), and the cache must follow the
file's content, not its name."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from locret import hf_gguf

TEXT = "Version 2.4.1 shipped on 2026-03-14; the door code is 46077.\n\tdef main():  # naïve café\n"


def test_cached_model_and_tokenizer_equal_transformers_own_reading(model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    direct = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                  dtype=torch.float32).eval()
    direct_tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    cached = hf_gguf.load_model(model_path).eval()
    cached_tok = hf_gguf.load_tokenizer(model_path)

    assert type(cached) is type(direct)
    a, b = direct.state_dict(), cached.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the output projection is tied to the embedding again, as in the model read from the GGUF
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()

    ids = direct_tok(TEXT)["input_ids"]
    assert cached_tok(TEXT)["input_ids"] == ids
    chat = [{"role": "user", "content": TEXT}]
    assert (cached_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == direct_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.equal(cached(x).logits, direct(x).logits)


@pytest.fixture
def counted_conversions(tmp_path, monkeypatch):
    """A cache in tmp_path whose conversions are counted and stubbed (the key, not transformers, is under test)."""
    monkeypatch.setenv("LOCRET_CACHE_DIR", str(tmp_path / "cache"))
    made = []

    def convert(gguf: Path, staging: Path) -> None:  # staging: the empty folder cachelock renames when this returns
        made.append(gguf)
        (staging / "done").write_text(gguf.name)

    monkeypatch.setattr(hf_gguf, "_convert", convert)
    return made


def test_cache_follows_the_file_content(tmp_path, counted_conversions):
    first = tmp_path / "a" / "m.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    folder = hf_gguf.folder(first)
    assert folder.parent == tmp_path / "cache" / "transformers" and (folder / "done").is_file()
    assert hf_gguf.folder(first) == folder and len(counted_conversions) == 1  # converted once

    same = tmp_path / "b" / "m.gguf"  # the same bytes elsewhere: the same folder
    same.parent.mkdir()
    shutil.copy(first, same)
    assert hf_gguf.folder(same) == folder and len(counted_conversions) == 1

    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))  # rewritten in place, one bit changed: converted anew
    os.utime(first, ns=(1, 1))
    assert hf_gguf.folder(first) != folder and len(counted_conversions) == 2


def test_a_model_too_large_to_keep_is_read_from_its_gguf(model_path, counted_conversions, monkeypatch):
    assert hf_gguf.float32_bytes(model_path) > 4 * 100_000_000  # SmolLM2-135M: about 135M weights of 4 bytes
    assert hf_gguf.source(model_path)[1] == {} and len(counted_conversions) == 1
    monkeypatch.setattr(hf_gguf, "KEEP_LIMIT_BYTES", hf_gguf.float32_bytes(model_path) - 1)
    assert hf_gguf.source(model_path) == (str(model_path.parent), {"gguf_file": model_path.name})
    assert len(counted_conversions) == 1  # nothing converted for it


def test_missing_and_unreadable_files_raise_and_leave_nothing(tmp_path, monkeypatch):
    from locret.gguf_header import ModelFileError

    monkeypatch.setenv("LOCRET_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError):
        hf_gguf.folder(tmp_path / "absent.gguf")
    with pytest.raises(ModelFileError, match="no such file"):
        hf_gguf.load_tokenizer(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelFileError, match="bad.gguf"):
        hf_gguf.load_model(bad)
    assert not (tmp_path / "cache" / "transformers").exists()
