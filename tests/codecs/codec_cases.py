"""Helpers shared by the codec tests (tests/codecs/)."""
from memfit.codecs import make_codec


def roundtrip(codec, x):
    c = make_codec(codec)
    c.fit(x)
    stored = c.encode(x)
    a, b = c.affine()
    shape = (1, -1) + (1,) * (x.dim() - 2)
    back = c.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
    return c, stored, back
