"""A broad sweep for the training memory model: `transformers` architectures of every common kind (`ARCHITECTURES`).

`memfit bench train --architectures` runs it. Each model is built from a small config with random weights
(nothing is downloaded) and trained the way its task is. GPT-2, Llama and T5 are in the test suite too; the
others were not used while the memory model was written. Causal LMs and seq2seq models train on `labels` in the
batch (`out.loss`), classifiers on cross-entropy of `out.logits`, a vision encoder on a made-up loss of its
last hidden state. For each, `memfit.memory_model(train=True)` (AdamW) is checked against the allocator's bytes of
real steps at two batch sizes that are not among the sizes it probes (`check_prediction`), so the figures
are predictions, not fits. Needs `transformers` (an optional dev dependency).

Run:
    memfit bench train --architectures
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch
from torch.nn import functional as F

from memfit.budget import format_bytes
from memfit.cli.bench.common import machine_header, table
from memfit.cli.bench.train_cases import Case, _seeded, hf_factory
from memfit.memory.prediction_check import check_prediction
from memfit.messages import first_line
from memfit.testing.zoo import quiet_transformers

__all__ = ["ARCHITECTURES", "TASKS", "architectures", "run"]

VOCAB, SEQ, CLASSES = 500, 32, 4


def _classifier_loss(out, y):
    return F.cross_entropy(out.logits, y)


def _own_loss(out, y=None):
    """The model's own loss (labels in the batch), else the mean square of the last hidden state (an encoder
    without a head)."""
    loss = getattr(out, "loss", None)
    return loss if loss is not None else out.last_hidden_state.float().pow(2).mean()


def _tokens(n: int) -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=_seeded(n)),
            "attention_mask": torch.ones(n, SEQ, dtype=torch.long)}


def _lm(n: int) -> dict:
    b = _tokens(n)
    b["labels"] = b["input_ids"].clone()
    return b


def _seq2seq(n: int) -> dict:
    return {**_tokens(n), "labels": torch.randint(1, VOCAB, (n, 8), generator=_seeded(n, 1))}


def _pixels(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 3, 32, 32, generator=_seeded(n))}


def _labels(n: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (n,), generator=_seeded(n, 2))


def _audio_features(n: int) -> dict:
    return {"input_features": torch.randn(n, 16, 64, generator=_seeded(n)),
            "labels": torch.randint(1, VOCAB, (n, 8), generator=_seeded(n, 1))}


def _waveform(n: int) -> dict:
    return {"input_values": torch.randn(n, 800, generator=_seeded(n))}


_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128}
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


# (name, task, model class, config class, config, batch, target)
_TABLE = [
    ("gpt2", "causal LM", "GPT2LMHeadModel", "GPT2Config",
     {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.0,
      "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}, _lm, None),
    ("llama", "causal LM", "LlamaForCausalLM", "LlamaConfig",
     {"vocab_size": VOCAB, "num_key_value_heads": 1, "max_position_embeddings": 64, **_SMALL}, _lm, None),
    ("mistral", "causal LM", "MistralForCausalLM", "MistralConfig",
     {"vocab_size": VOCAB, "num_key_value_heads": 1, "max_position_embeddings": 64, **_SMALL}, _lm, None),
    ("qwen2", "causal LM", "Qwen2ForCausalLM", "Qwen2Config",
     {"vocab_size": VOCAB, "num_key_value_heads": 1, "max_position_embeddings": 64, **_SMALL}, _lm, None),
    ("phi", "causal LM", "PhiForCausalLM", "PhiConfig",
     {"vocab_size": VOCAB, "max_position_embeddings": 64, **_SMALL}, _lm, None),
    ("opt", "causal LM", "OPTForCausalLM", "OPTConfig",
     {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "ffn_dim": 128,
      "max_position_embeddings": 64, "word_embed_proj_dim": 64, "dropout": 0.0}, _lm, None),
    ("gpt_neo", "causal LM", "GPTNeoForCausalLM", "GPTNeoConfig",
     {"vocab_size": VOCAB, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "window_size": 8,
      "attention_types": [[["global", "local"], 1]], "max_position_embeddings": 64}, _lm, None),
    ("falcon", "causal LM", "FalconForCausalLM", "FalconConfig",
     {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}, _lm, None),
    ("t5", "seq2seq", "T5ForConditionalGeneration", "T5Config",
     {"vocab_size": VOCAB, "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 2, "d_kv": 32,
      "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0}, _seq2seq, None),
    ("bart", "seq2seq", "BartForConditionalGeneration", "BartConfig",
     {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
      "decoder_attention_heads": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
      "max_position_embeddings": 64, "dropout": 0.0, "attention_dropout": 0.0}, _seq2seq, None),
    ("whisper", "speech seq2seq", "WhisperForConditionalGeneration", "WhisperConfig",
     {"vocab_size": VOCAB, "d_model": 64, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
      "decoder_attention_heads": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 16,
      "max_source_positions": 32, "max_target_positions": 32, "decoder_start_token_id": 0, "pad_token_id": 0},
     _audio_features, None),
    ("distilbert", "text classifier", "DistilBertForSequenceClassification", "DistilBertConfig",
     {"vocab_size": VOCAB, "dim": 64, "n_layers": 2, "n_heads": 2, "hidden_dim": 128, "num_labels": CLASSES,
      "dropout": 0.0, "attention_dropout": 0.0}, _tokens, _labels),
    ("albert", "text classifier", "AlbertForSequenceClassification", "AlbertConfig",
     {"vocab_size": VOCAB, "embedding_size": 32, "num_labels": CLASSES, **_SMALL, **_NO_DROPOUT}, _tokens, _labels),
    ("roberta", "text classifier", "RobertaForSequenceClassification", "RobertaConfig",
     {"vocab_size": VOCAB, "num_labels": CLASSES, "max_position_embeddings": 64, **_SMALL, **_NO_DROPOUT},
     _tokens, _labels),
    ("wav2vec2", "audio classifier", "Wav2Vec2ForSequenceClassification", "Wav2Vec2Config",
     {"vocab_size": VOCAB, "num_labels": CLASSES, "conv_dim": (16, 16), "conv_stride": (5, 2),
      "conv_kernel": (10, 3), "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2,
      "hidden_dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "feat_proj_dropout": 0.0,
      "layerdrop": 0.0, "mask_time_prob": 0.0, **_SMALL}, _waveform, _labels),
    ("deit", "image classifier", "DeiTForImageClassification", "DeiTConfig",
     {"image_size": 32, "patch_size": 8, "num_labels": CLASSES, **_SMALL, **_NO_DROPOUT}, _pixels, _labels),
    ("swin", "image classifier", "SwinForImageClassification", "SwinConfig",
     {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 4,
      "num_labels": CLASSES}, _pixels, _labels),
    ("regnet", "image classifier", "RegNetForImageClassification", "RegNetConfig",
     {"num_labels": CLASSES, "hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16,
      "groups_width": 8}, _pixels, _labels),
    ("clip_vision", "vision encoder", "CLIPVisionModel", "CLIPVisionConfig",
     {"image_size": 32, "patch_size": 8, **_SMALL}, _pixels, None),
]

ARCHITECTURES = [row[0] for row in _TABLE]
TASKS = {row[0]: row[1] for row in _TABLE}


def _case(name, model: str, config: str, cfg: dict, batch, target) -> Case:
    import transformers
    x_y = (lambda n: (batch(n), target(n))) if target is not None else (lambda n: (batch(n), None))
    return Case(name, hf_factory(getattr(transformers, model), getattr(transformers, config)(**cfg)), x_y,
                _classifier_loss if target is not None else _own_loss)


def architectures(names=None) -> list[Case]:
    """The sweep's models (all, or those named), as the training benchmark's `Case`s: `batch(n)` gives (x, y),
    y None where the labels are in x."""
    unknown = sorted(set(names or ()) - set(ARCHITECTURES))
    if unknown:
        raise ValueError(f"unknown architectures {unknown}; expected some of {ARCHITECTURES}")
    quiet_transformers()
    return [_case(name, model, config, cfg, batch, target)
            for name, _, model, config, cfg, batch, target in _TABLE if names is None or name in names]


def run(names=None, sizes: tuple[int, ...] = (3, 6), as_json: bool = False) -> list[dict]:
    """Predicted / measured training-step peak (AdamW) of each architecture at `sizes`, and the seconds of a
    prediction against one real step; prints the table and PASS/MISS on [1.00, 1.05] for every row. A model
    memfit cannot predict is a row with the reason, and a MISS. Unknown names raise ValueError before anything
    runs."""
    cases = architectures(names)
    print(machine_header("cpu"))
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        model = case.make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        row = {"model": case.name, "task": TASKS[case.name]}
        labelled = case.batch(1)[1] is not None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")            # transformers' notes on its random-weight configs
                checks = check_prediction(model, lambda n, c=case: c.batch(n)[0], sizes, optimizer=opt,
                                          loss_fn=case.loss,
                                          target_at=(lambda n, c=case: c.batch(n)[1]) if labelled else None)
        except Exception as e:                             # a row says why, and the verdict counts it
            rows.append({**row, "error": first_line(e)[:160]})
            continue
        for c in checks:
            row[f"measured {c['n']}"] = format_bytes(c["measured"])
            row[f"pred/meas {c['n']}"] = f"{c['ratio']:.3f}"      # three decimals: the target is 1.00-1.05
        row["predict s"] = checks[0]["predict_s"]
        row[f"predict / step {sizes[-1]}"] = checks[0]["predict_s"] / checks[-1]["step_s"]
        rows.append(row)
        print(f"# {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(f"# training-step memory of {len(rows)} transformers architectures (small configs, random weights), "
          f"AdamW: memfit.memory_model(train=True) against the allocator's bytes of real steps at batch {sizes[0]} and "
          f"{sizes[1]} (sizes it does not probe); predict / step: one prediction against one real step at "
          f"{sizes[-1]} (these models are tiny: see the predict-cost rows of `memfit bench train`)")
    columns = ("model", "task", *[f"{w} {n}" for n in sizes for w in ("measured", "pred/meas")], "predict s",
               f"predict / step {sizes[-1]}")
    print(table([{k: r.get(k, "") for k in columns} for r in rows if "error" not in r]))
    failed = [r for r in rows if "error" in r]
    for r in failed:
        print(f"# {r['model']}: could not predict: {r['error']}")
    ratios = [float(r[f"pred/meas {n}"]) for r in rows if "error" not in r for n in sizes]
    lo, hi = (min(ratios), max(ratios)) if ratios else (float("nan"), float("nan"))
    ok = not failed and ratios and lo >= 1.0 and hi <= 1.05
    print(f"{'PASS' if ok else 'MISS'}  predicted / measured in [{lo:.3f}, {hi:.3f}] on {len(rows) - len(failed)} "
          f"of {len(rows)} architectures (target: all, within [1.00, 1.05])")
    if as_json:
        print(json.dumps(rows, default=str))
    return rows
