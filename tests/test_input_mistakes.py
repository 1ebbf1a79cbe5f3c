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
