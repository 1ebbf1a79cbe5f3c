"""What torch's error text says about the user's inputs, turned into what to fix: one home for reading it.

torch reports an input of the wrong shape or dtype deep inside a layer ("mat1 and mat2 shapes cannot be
multiplied", "expected scalar type Long"). The planner's capture (`input_hint`) and evaluate
(`dtype_mistake`) read that text here and say what was found and how to fix it.
"""

from __future__ import annotations

from memfit.batches import batch_tensors
from memfit.messages import first_line

__all__ = ["dtype_mistake", "input_hint"]


def input_hint(message: str, inputs: tuple) -> str:
    """How to fix a shape or dtype mistake that torch reported as `message`."""
    found = ", ".join(f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" for x in inputs)
    m = message.lower()
    if "indices" in m and ("long" in m or "int" in m):
        return (f"the model looks up embeddings and needs integer token ids; found {found}: give torch.long "
                "inputs (--dtype int64 in the CLI)")
    if "channels" in m:
        return f"the input's channel count differs from what the first layer expects; found {found}"
    if "expected" in m and ("d (batched)" in m or "unbatched" in m or "dimension" in m or "dims" in m):
        return (f"the input has a dimension too many or too few; found {found}: give the shape of one sample "
                "with no batch (e.g. 3,32,32), the batch comes first")
    if "shapes cannot be multiplied" in m or "size of tensor" in m or "must match" in m:
        return f"the input's feature size differs from what the model expects; found {found}"
    return f"check the example inputs' shapes and dtypes; found {found}"


def dtype_mistake(e: BaseException, x, model=None) -> TypeError | None:
    """A TypeError saying the inputs have the wrong dtype for `model` (what was found, and how to fix it), when
    torch's error is one of its dtype mismatches; else None. `model` (optional) names its parameters' dtype."""
    text = str(e)
    if not isinstance(e, RuntimeError) or x is None or not any(
            k in text for k in ("scalar type", "scalar types", "same dtype", "should be the same", "expected both")):
        return None
    if "device" in text or "cuda" in text.lower():     # tensors on different devices: not a dtype mistake
        return None
    dtypes = sorted({_name(t.dtype) for t in batch_tensors(x)})
    floats = all(t.is_floating_point() for t in batch_tensors(x))
    params = sorted({_name(p.dtype) for p in model.parameters() if p.is_floating_point()}) if model is not None else []
    if floats and ("Long" in text or "Int" in text):
        fix = ("the model wants integer inputs (token ids, e.g. an Embedding first); give integer arrays (they "
               "decode to int64) or CompactDataset.from_arrays(..., dtype=torch.long); on the command line "
               "--dtype int64")
    elif floats and len(params) == 1:
        want = params[0]
        convert = (f"x.astype(np.{want}) for a numpy array, torch.from_numpy(x).{_method(want)}() or "
                   f"x.{_method(want)}() for a tensor") if want in ("float32", "float64", "float16") else \
            f"x.to(torch.{want}) for a tensor"
        fix = (f"the model's parameters are {want}: give {want} inputs ({convert}; or "
               f"CompactDataset.from_arrays(..., dtype=torch.{want}), --dtype {want} on the command line), or "
               f"convert the model with model.to(torch.{dtypes[0]})")
    elif floats:
        fix = ("the model's parameters have another float dtype than the inputs"
               + (f" ({', '.join(params)})" if params else "") + "; build the data in the model's dtype "
               "(CompactDataset.from_arrays(..., dtype=...), --dtype on the command line) or convert the model "
               "with model.to(the inputs' dtype)")
    else:
        fix = ("the model wants float inputs; build the data with a float dtype, e.g. "
               "CompactDataset.from_arrays(..., dtype=torch.float32); on the command line --dtype float32")
    return TypeError(f"the inputs are {', '.join(dtypes)} but {fix} ({first_line(e)})")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _method(name: str) -> str:
    """The tensor method that converts to a float dtype: float32 -> float, float64 -> double, float16 -> half."""
    return {"float32": "float", "float64": "double", "float16": "half"}[name]
