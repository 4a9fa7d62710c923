"""Workarounds for CUDA library faults seen on a GPU (flowrl.utils.cuda_quirks)."""
import torch

import flowrl.utils.cuda_quirks as quirks


def test_cudnn_attention_is_turned_off_on_torch_2_11_cuda_only():
    assert "cuDNN attention off" in quirks.cudnn_sdpa_problem("2.11.0+cu130", "cuda")
    assert quirks.cudnn_sdpa_problem("2.11.0+cu130", "cpu") is None
    assert quirks.cudnn_sdpa_problem("2.11.0+cu130", "cuda", keep=True) is None  # FLOWRL_CUDNN_SDPA=1
    assert quirks.cudnn_sdpa_problem("2.14.1+cu130", "cuda") is None


def test_apply_turns_the_backend_off_and_says_so_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    monkeypatch.setattr(quirks, "_APPLIED", [])
    monkeypatch.delenv("FLOWRL_CUDNN_SDPA", raising=False)
    assert quirks.apply_cuda_workarounds("cpu") == [] and calls == []
    assert len(quirks.apply_cuda_workarounds(torch.device("cuda", 0))) == 1 and calls == [False]
    quirks.apply_cuda_workarounds("cuda")
    assert capsys.readouterr().err.count("cuDNN attention off") == 1  # said once per process
    monkeypatch.setenv("FLOWRL_CUDNN_SDPA", "1")
    assert quirks.apply_cuda_workarounds("cuda") == [] and calls == [False, False]
