"""WorkloadSpec: the one way from import strings to a workload (CLI, isolation, scripts)."""

from __future__ import annotations

import pickle

import pytest

from dptune import Tuner, WorkloadSpec
from dptune.errors import ImportStringError, UsageError
from dptune.step.presets import LOSSES, OPTIMIZERS

GPT = "dptune.examples.models:TinyGPT"
SMALL = {"vocab_size": 64, "d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8}


@pytest.mark.parametrize("kwargs, fragment", [
    ({"sample": "m:f", "input_shape": (3,)}, "not both"),
    ({"dtype": "float16"}, "give it too"),
    ({"input_shape": (3,), "dtype": "long"}, "needs --vocab-size"),
    ({"input_shape": (3,), "dtype": "float16", "vocab_size": 9}, "is for token ids"),
    ({"input_shape": (3,), "dtype": "int8"}, "choose one of float32"),
    ({"input_shape": (0, 3)}, "positive ints"),
    ({"input_shape": 784}, "tuple of positive ints"),
    ({"loss": "hinge"}, "--loss 'hinge': choose one of default"),
    ({"optimizer": "lion"}, "--optimizer 'lion': choose one of adamw"),
    ({"optimizer_kwargs": {"lr": 1.0}}, "not the built-in 'adamw'"),
    ({"step": "train_step"}, "MODULE:FUNC"),
    ({"model_kwargs": [1]}, "must be a mapping"),
])
def test_a_spec_that_cannot_work_fails_when_made(kwargs, fragment):
    with pytest.raises(UsageError, match=fragment):
        WorkloadSpec(GPT, **kwargs)


def test_strings_that_name_nothing_fail_when_built():
    spec = WorkloadSpec("no_such_module_xyz:Net")        # made fine: nothing imported yet
    with pytest.raises(ImportStringError, match="no_such_module_xyz"):
        spec.build()
    with pytest.raises(ImportStringError, match="has no attribute 'nope'"):
        WorkloadSpec(GPT, loss="dptune.step.presets:nope").build()


def test_spec_and_built_workload_pickle_and_name_the_same_builtins():
    spec = WorkloadSpec(GPT, model_kwargs=SMALL, loss="cross_entropy", optimizer="sgd",
                        amp="bf16", accumulate=2, clip_grad_norm=1.0)
    child = pickle.loads(pickle.dumps(spec))
    assert child == spec
    wl = child.build()
    assert wl.loss_fn is LOSSES["cross_entropy"] and wl.optimizer is OPTIMIZERS["sgd"]
    assert (wl.amp, wl.accumulate, wl.clip_grad_norm) == ("bf16", 2, 1.0)
    model = wl.model()
    assert type(model).__name__ == "TinyGPT" and model.vocab_size == 64
    again = pickle.loads(pickle.dumps(wl))               # a built model does not travel
    assert again.sample(3).shape == (3, 8)


def test_models_own_sample_reads_a_meta_model_until_the_real_one_is_built():
    wl = WorkloadSpec(GPT, model_kwargs=SMALL, sample=".sample_with_targets").build()
    ids, targets = wl.sample(2)          # no model built yet: from a meta instance
    assert ids.shape == targets.shape == (2, 8) and not ids.is_meta
    model = wl.model()
    factory = wl.model.factory
    assert factory.last is model         # now the built model's method is called
    assert wl.sample(1)[0].shape == (1, 8)


def test_no_sample_message_is_the_same_for_cli_and_api(capsys):
    from dptune.cli import main

    with pytest.raises(UsageError) as api:
        WorkloadSpec("torch.nn:Identity").build()
    code = main(["search", "--model", "torch.nn:Identity", "--simulate", "2x2GB", "--quiet",
                 "--no-plots"])
    err = capsys.readouterr().err
    assert code == 2 and str(api.value) in err
    assert "Identity has no sample(batch_size) method" in err


def test_from_spec_tunes_the_step_the_spec_describes():
    spec = WorkloadSpec(GPT, model_kwargs=SMALL, loss="cross_entropy", amp="bf16", accumulate=2)
    result = Tuner.from_spec(spec, 8, simulate="2x24GB", verbose=False, max_probes=4).fit()
    assert result.model_name == "TinyGPT" and sum(result.chunk_sizes) == 8
    assert (result.settings.amp, result.settings.accumulate) == ("bf16", 2)
    assert result.model is None          # a factory on the simulated cluster: nothing built


def test_isolation_without_a_visible_gpu_says_so(monkeypatch):
    import dptune.backends.choice as choice_mod
    from dptune.errors import BackendUnavailableError

    monkeypatch.setattr(choice_mod, "_visible_gpus", lambda: 0)
    with pytest.raises(BackendUnavailableError, match="no GPU is visible here"):
        Tuner.from_spec(WorkloadSpec("no_such_module_xyz:Net"), 8, isolate=True)


def test_isolation_is_for_real_cards_and_checked_before_importing():
    spec = WorkloadSpec("no_such_module_xyz:Net")
    with pytest.raises(UsageError, match="does not apply to simulated cards"):
        Tuner.from_spec(spec, 8, simulate="2x2GB", isolate=True)
    with pytest.raises(UsageError, match="banana"):
        Tuner.from_spec(spec, 8, simulate="4xbanana")
