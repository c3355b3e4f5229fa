"""examples/05-own-model/spec.yaml as its README says it works: `model: ./my-model` is relative to the
spec's folder, from any working directory; a missing model names the path it resolved to. The model
here is its metadata only: config.json, a safetensors file's header and a tokenizer.json (validate
reads no weights); the example's own test
(tests/examples_tests/test_own_model_example.py) runs a real checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from slotune.tuner.cli import app
from typer.testing import CliRunner

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "05-own-model"

# a config.json the engine would load (tune validate checks that, from the config alone)
LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
}


def test_own_model_example_resolves_model_against_its_folder(tmp_path, monkeypatch):
    ex = tmp_path / "ex"
    ex.mkdir()
    shutil.copy(EXAMPLE / "spec.yaml", ex / "spec.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = CliRunner().invoke(app, ["validate", "../ex/spec.yaml"])
    assert r.exit_code == 2
    assert f"../ex/spec.yaml: model: model '{ex / 'my-model'}': not a bundled name" in r.stderr
    (ex / "my-model").mkdir()
    (ex / "my-model" / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096}))
    r = CliRunner().invoke(app, ["validate", "../ex/spec.yaml"])
    assert r.exit_code == 2 and "my-model: no *.safetensors files" in r.stderr
    # the check reads the safetensors headers (tensor names) and that tokenizer.json is there
    save_file(
        {"model.embed_tokens.weight": np.zeros((256, 64), np.float32)}, str(ex / "my-model" / "model.safetensors")
    )
    (ex / "my-model" / "tokenizer.json").write_text("{}")
    r = CliRunner().invoke(app, ["validate", "../ex/spec.yaml"])
    assert r.exit_code == 2 and "config.json: no 'num_attention_heads', which the model needs" in r.stderr
    (ex / "my-model" / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "max_position_embeddings": 4096}))
    r = CliRunner().invoke(app, ["validate", "../ex/spec.yaml"])
    assert r.exit_code == 0, r.stderr
    assert f"model:{ex / 'my-model'}" in "".join(r.stdout.split())  # however the console wrapped a long path
    assert "relative to the folder the spec file is in" in " ".join((EXAMPLE / "README.md").read_text().split())
