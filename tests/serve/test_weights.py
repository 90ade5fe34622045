"""A rollout service's checks of a weights version (mugrpo.serve.weights): where the file may lie, and what
it must hold (every parameter once, none unknown, shapes and dtypes equal)."""
import os

import pytest
import torch
from safetensors.torch import save_file

from mugrpo.serve.weights import WeightsRefused, check_against, files_inside, header_of_files, spec_of_parameters

pytestmark = pytest.mark.unit

SPEC = {"a.weight": ((2, 3), "float32"), "b.weight": ((3,), "float32")}


def _refused(status: int, says: str):
    class Match:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            assert isinstance(exc, WeightsRefused), exc
            assert exc.status == status and says in str(exc), str(exc)
            return True
    return Match()


def test_only_files_inside_the_folder_are_opened(tmp_path):
    folder, outside = tmp_path / "w", tmp_path / "elsewhere.safetensors"
    folder.mkdir()
    save_file({"a.weight": torch.zeros(2, 3)}, str(folder / "v1.safetensors"))
    save_file({"a.weight": torch.zeros(2, 3)}, str(outside))
    os.symlink(outside, folder / "link.safetensors")
    (folder / "sub").mkdir()
    os.symlink(outside, folder / "sub" / "x.safetensors")
    assert files_inside(str(folder), "v1.safetensors") == [folder / "v1.safetensors"]
    assert files_inside(str(folder), str(folder / "v1.safetensors")) == [folder / "v1.safetensors"]
    for path in [str(outside), "../elsewhere.safetensors", "link.safetensors", "/etc/passwd", ".", "sub"]:
        with _refused(403, "--weights-dir"):
            files_inside(str(folder), path)
    with _refused(404, "no safetensors file at 'v2.safetensors'"):
        files_inside(str(folder), "v2.safetensors")


def test_a_version_must_hold_exactly_the_models_parameters():
    check_against({"b.weight": ((3,), "float32"), "a.weight": ((2, 3), "float32")}, SPEC)  # order is free
    with _refused(400, "tensor 'c' is not a parameter"):
        check_against({**SPEC, "c": ((1,), "float32")}, SPEC)
    with _refused(400, "1 of the model's 2 parameters are missing, the first 'b.weight'"):
        check_against({"a.weight": ((2, 3), "float32")}, SPEC)
    with _refused(400, "tensor 'b.weight' has shape [1], the model's parameter has [3]"):  # no broadcasting
        check_against({**SPEC, "b.weight": ((1,), "float32")}, SPEC)
    with _refused(400, "tensor 'a.weight' is int64, the service runs in float32"):  # no silent cast
        check_against({**SPEC, "a.weight": ((2, 3), "int64")}, SPEC)


def test_headers_are_read_without_the_tensors_and_a_name_in_two_files_is_refused(tmp_path):
    save_file({"a.weight": torch.zeros(2, 3)}, str(tmp_path / "1.safetensors"))
    save_file({"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(3, dtype=torch.bfloat16)},
              str(tmp_path / "2.safetensors"))
    assert header_of_files([tmp_path / "2.safetensors"]) == {"a.weight": ((2, 3), "float32"),
                                                             "b.weight": ((3,), "bfloat16")}
    with _refused(400, "tensor 'a.weight' is in both 1.safetensors and 2.safetensors"):
        header_of_files([tmp_path / "1.safetensors", tmp_path / "2.safetensors"])
    (tmp_path / "bad.safetensors").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    with _refused(400, "bad.safetensors is not a readable safetensors file"):
        header_of_files([tmp_path / "bad.safetensors"])


def test_the_spec_of_a_model_lists_tied_weights_once():
    emb = torch.nn.Embedding(5, 4)
    model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(4, 5, bias=False)})
    model["head"].weight = emb.weight  # tied, as SmolLM2's LM head
    assert spec_of_parameters(model.named_parameters()) == {"emb.weight": ((5, 4), "float32")}
