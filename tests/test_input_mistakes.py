"""input_mistakes: torch's error text about the inputs, read into what to fix."""
import torch

from memfit.input_mistakes import dtype_mistake, input_hint


def test_dtype_diagnosis_names_the_right_mistake():
    """torch's 'should be the same' covers devices and float widths too: only dtype mistakes become a dtype
    error, and a float-width mismatch says so (not 'the model wants float inputs')."""
    x = torch.zeros(2, 3)
    device = RuntimeError("Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same")
    assert dtype_mistake(device, x) is None
    half = RuntimeError("Input type (float) and bias type (c10::Half) should be the same")
    assert "another float dtype" in str(dtype_mistake(half, x))
    ids = RuntimeError("Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int")
    assert "integer inputs" in str(dtype_mistake(ids, x))


def test_a_shape_mistake_names_what_was_found_and_the_fix():
    inputs = (torch.zeros(2, 5),)
    hint = input_hint("mat1 and mat2 shapes cannot be multiplied (2x5 and 4x3)", inputs)
    assert "feature size" in hint and "(2, 5) float32" in hint
    assert "integer token ids" in input_hint("Expected tensor for argument #1 'indices' to have scalar type Long",
                                             inputs)
    assert "dimension too many or too few" in input_hint("Expected 3D (unbatched) or 4D (batched) input", inputs)


def test_float64_arrays_for_a_float32_model_say_what_was_found_and_the_conversion():
    """numpy's default float64 given to a float32 model: the error names both dtypes and the conversion (it
    used to speak of 'a .half() model')."""
    import numpy as np
    import pytest

    import memfit
    x, y = np.random.default_rng(0).normal(size=(10, 3)), np.arange(10) % 2          # x float64
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match=r"inputs are float64 but the model's parameters are float32: .*"
                                        r"x\.astype\(np\.float32\).*torch\.from_numpy\(x\)\.float\(\)") as err:
        memfit.evaluate(model, (x, y), progress=False)
    assert ".half()" not in str(err.value)
    r = memfit.evaluate(model, (x.astype(np.float32), y), progress=False)          # the fix it names works
    assert r.n == 10
    half = RuntimeError("Input type (float) and bias type (c10::Half) should be the same")
    assert "parameters are float16: give float16 inputs" in str(dtype_mistake(half, torch.zeros(2, 3),
                                                                              torch.nn.Linear(3, 2).half()))
