"""The README's recipes, each verbatim as a function (its body is the recipe: imports included, generated data,
no download), run and checked against a plain PyTorch reference computed on the same decoded data.

Run: `python -m pytest -q tests/test_recipes.py`.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F


def recipe_classification():
    import torch

    import memfit

    x, y = memfit.readers.synthetic(2000, seed=0)                       # uint8 images (2000, 1, 28, 28), class ids
    train = memfit.loader((x[:1600], y[:1600]), 128, normalize="dataset", seed=0)      # compact, on the GPU if any
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(train.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _epoch in range(3):                                             # each pass a new shuffle
        for xb, yb in train:                                             # float32 (128, 1, 28, 28), int64 (128,)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    test = memfit.CompactDataset.from_arrays(x[1600:], y[1600:], normalize=(train.dataset.mean, train.dataset.std))
    res = memfit.evaluate(model, test)                                   # accuracy + loss over the whole test set
    print(res["accuracy"], res["loss"])
    return model, test, res


def recipe_causal_lm():
    import numpy as np
    import torch
    import transformers

    import memfit

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=32,
                                                                 n_layer=2, n_head=2))    # random weights
    rng = np.random.default_rng(0)
    mask = (np.arange(16) < rng.integers(4, 17, (64, 1))).astype(np.int64)   # right padding, (64, 16)
    ids = rng.integers(1, 100, (64, 16)) * mask                              # pad id 0
    labels = np.full_like(ids, -100)                                         # -100: no loss there
    labels[:, :-1] = np.where(mask[:, 1:] == 1, ids[:, 1:], -100)            # the next token, where there is one
    data = ({"input_ids": ids, "attention_mask": mask}, labels)
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), y)   # mean over tokens
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for xb, yb in memfit.loader(data, 32, seed=0):                          # dict batches: model(**xb)
        memfit.accumulate(model, opt, (xb, yb), loss_fn, micro_batch=8,   # micro_batch="auto": from a budget
                          terms=lambda x, y: (y != -100).sum())             # weighted by tokens, not samples
    res = memfit.evaluate(model, data, metrics=("loss", "perplexity", "accuracy"))   # over non-ignored tokens
    print(res["perplexity"])
    return model, data, res


def recipe_regression():
    import numpy as np
    import torch

    import memfit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 2)) + 0.1 * rng.normal(size=(1000, 2))).astype(np.float32)   # float targets
    train = memfit.loader((x[:800], y[:800]), 64, seed=0)                   # y decodes to float32 (64, 2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(train.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _epoch in range(10):                                             # each pass a new shuffle
        for xb, yb in train:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    res = memfit.evaluate(model, (x[800:], y[800:]))                        # float targets: mse + mae
    print(res["mse"], res["mae"])
    return model, (x[800:], y[800:]), res


def recipe_segmentation():
    import numpy as np
    import torch

    import memfit

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (200, 3, 16, 16), dtype=np.uint8)
    masks = (x[:, 0] > 128).astype(np.int64) + (x[:, 1] > 128)              # class 0..2 per pixel, (200, 16, 16)
    masks[:, :, :2] = 255                                                    # "void": labelled nowhere
    train = memfit.loader((x[:160], masks[:160]), 16, normalize="dataset", ignore_index=255, seed=0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 1), torch.nn.ReLU(),   # a U-Net goes here
                                torch.nn.Conv2d(16, 3, 1)).to(train.device)  # (B, 3, 16, 16) class scores
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _epoch in range(3):                                             # each pass a new shuffle
        for xb, yb in train:                                                 # yb: int64 (16, 16, 16)
            loss = torch.nn.functional.cross_entropy(model(xb), yb, ignore_index=255)
            opt.zero_grad()
            loss.backward()
            opt.step()
    test = memfit.CompactDataset.from_arrays(x[160:], masks[160:], normalize=(train.dataset.mean, train.dataset.std),
                                             ignore_index=255)
    res = memfit.evaluate(model, test, metrics=("accuracy", "iou", "loss"))  # pixels, void left out
    print(res["accuracy"], res["iou"])
    return model, test, res


# ---- the checks -----------------------------------------------------------------------------------
def outputs(model, ds):
    """The model's float64 outputs and the targets, on the dataset's own decoded data."""
    x, y = ds.batch(slice(None))
    with torch.no_grad():
        return model.eval()(x).double(), y


def test_classification(capsys):
    model, test, res = recipe_classification()
    z, y = outputs(model, test)
    assert res["accuracy"] == (z.argmax(1) == y).double().mean().item() > 0.5          # chance: 0.1
    assert res["loss"] == pytest.approx(F.cross_entropy(z, y).item(), rel=1e-6)
    assert capsys.readouterr().out.strip()


def test_causal_lm():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, (x, labels), res = recipe_causal_lm()
    ids, mask, y = (torch.from_numpy(a) for a in (x["input_ids"], x["attention_mask"], labels))
    with torch.no_grad():
        z = model.eval()(input_ids=ids, attention_mask=mask).logits.double()
    keep = y != -100
    ce = F.cross_entropy(z.transpose(1, 2), y).item()                  # torch's mean over non-ignored tokens
    assert res["loss"] == pytest.approx(ce, rel=1e-5) and res["perplexity"] == pytest.approx(math.exp(ce), rel=1e-5)
    assert res["accuracy"] == (z.argmax(-1) == y)[keep].double().mean().item()
    assert res["perplexity"] < 100                                      # below a uniform guess over 100 tokens


def test_regression():
    model, (x, y), res = recipe_regression()
    with torch.no_grad():
        err = model.eval()(torch.from_numpy(x)).double() - torch.from_numpy(y).double()
    assert res["mse"] == pytest.approx((err ** 2).mean().item(), rel=1e-6)
    assert res["mae"] == pytest.approx(err.abs().mean().item(), rel=1e-6)
    assert res["mse"] < 0.5 * float(np.var(y))                         # it learned something


def test_segmentation():
    model, test, res = recipe_segmentation()
    z, y = outputs(model, test)
    keep, pred = y != 255, z.argmax(1)
    assert res["accuracy"] == (pred == y)[keep].double().mean().item() > 0.6
    iou = [((pred == c) & (y == c)).sum().item() / (((pred == c) | (y == c)) & keep).sum().item() for c in range(3)]
    assert res["iou"] == pytest.approx(np.mean(iou), rel=1e-12)
    assert res["loss"] == pytest.approx(F.cross_entropy(z, y, ignore_index=255).item(), rel=1e-6)


def test_the_readme_shows_each_recipe_as_it_runs_here():
    """The README's recipes are these functions' bodies, word for word (less the hand-off to the checks): the
    page cannot drift from what the tests run."""
    import ast
    import re
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    src = Path(__file__).read_text()
    lines = src.splitlines(keepends=True)
    for node in ast.parse(src).body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("recipe_")):
            continue
        name = node.name.removeprefix("recipe_").replace("_", "-")
        if name == "classification":          # the README's own classification example runs in tests/test_docs.py
            continue
        body = textwrap.dedent("".join(lines[node.body[0].lineno - 1:node.end_lineno]))
        body = re.sub(r"\nreturn [^\n]*\n?$", "\n", body.rstrip("\n") + "\n")
        shown = re.search(r"<!-- recipe: " + name + r" -->.*?```python\n(.*?)```", readme, re.S)
        assert shown, f"README.md has no recipe block for {name}"
        assert shown.group(1) == body, f"README.md's {name} recipe differs from {node.name} in {__file__}"
