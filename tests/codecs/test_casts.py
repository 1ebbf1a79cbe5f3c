"""memfit.codecs.casts: the float casts report their error."""
import pytest
import torch
from codec_cases import roundtrip


def test_fp16_and_bf16_report_their_error():
    x = torch.tensor([[1 / 3, 1000.1, -2.5]], dtype=torch.float32)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c, stored, back = roundtrip(name, x)
        assert stored.dtype == dtype
        assert c.max_abs_error == pytest.approx((x.double() - x.to(dtype).double()).abs().max().item())
