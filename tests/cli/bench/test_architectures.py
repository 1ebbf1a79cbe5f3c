"""The broad sweep of `memfit bench train --architectures`: transformers models nobody here tuned the memory
model on, each checked against the live bytes of real training steps (memfit.device.measure) at batch sizes the
memory model does not probe."""
import pytest
import torch

from memfit.cli.bench.architectures import ARCHITECTURES, architectures
from memfit.memory.prediction_check import check_prediction

pytest.importorskip("transformers")

# one of each kind, the quickest: a causal LM with grouped-query attention, a speech seq2seq, an audio
# classifier (convolutional feature encoder) and a windowed-attention vision model (the whole sweep: the benchmark)
SAMPLE = ["falcon", "whisper", "wav2vec2", "swin"]


@pytest.mark.parametrize("name", SAMPLE)
def test_the_training_memory_model_matches_real_steps(name):
    from memfit.testing.zoo import quiet_transformers
    quiet_transformers()
    case, = architectures([name])
    model = case.make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    target_at = (lambda n: case.batch(n)[1]) if case.batch(1)[1] is not None else None
    for row in check_prediction(model, lambda n: case.batch(n)[0], (3, 5), optimizer=opt, loss_fn=case.loss,
                                target_at=target_at):
        assert 1.0 <= row["ratio"] <= 1.05, (name, row)


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown architectures \['nope'\]; expected some of .*'gpt2'"):
        architectures(["nope"])
    assert len(ARCHITECTURES) == len(set(ARCHITECTURES)) == len(architectures())


@pytest.mark.parametrize("argv, says", [
    (["--architectures", "gpt2,nope"], "--architectures: unknown architectures ['nope']; expected some of"),
    (["--architectures", "--quick", "--models", "mlp"], "takes no --quick, --models; drop them"),
    (["--architectures", "gpt2", "--sizes", "2,4"], "takes no --sizes; drop it")])
def test_the_cli_flag_refuses_unknown_names_and_options_it_would_ignore(capsys, argv, says):
    from memfit.cli.bench.train import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
