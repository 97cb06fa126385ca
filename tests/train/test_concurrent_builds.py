"""Jobs built on several threads at once (a server's job queue starts them together) pass
through LlamaFactory's parser and transformers' loading one at a time: both change
process-global state while they run (harvest.train.llamafactory_env.LOADING_LOCK). Seen
before the lock: "LlamaFactory rejected the job: Only `Union[X, NoneType]` is allowed ...
field 'debug'" for one of two jobs started together."""

from __future__ import annotations

import threading
import time

import pytest

from tests.threads import on_threads
from tests.train.trainer_helpers import job_dict


class _Overlap:
    """Wraps a function: how many threads were inside it at once, at most."""

    def __init__(self, function):
        self.function = function
        self.inside = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            time.sleep(0.3)  # long enough that a second thread would be let in
            return self.function(*args, **kwargs)
        finally:
            with self.lock:
                self.inside -= 1


def test_jobs_parsed_on_several_threads_go_through_llamafactory_one_at_a_time(tiny_llama_path, tmp_path,
                                                                             monkeypatch):
    import llamafactory.hparams

    from harvest.train.job import import_llamafactory, load_job

    import_llamafactory()
    overlap = _Overlap(llamafactory.hparams.get_train_args)
    monkeypatch.setattr(llamafactory.hparams, "get_train_args", overlap)
    jobs, errors = on_threads(lambda i: load_job(job_dict(tiny_llama_path, tmp_path / f"out{i}")), 3, timeout_s=300)
    assert not errors and None not in jobs, errors
    assert overlap.most == 1


@pytest.mark.slow
def test_trainers_built_on_several_threads_load_their_models_one_at_a_time(tiny_llama_path, tmp_path, monkeypatch):
    import llamafactory.model

    from harvest.train.build import build_trainer
    from harvest.train.job import load_job

    overlap = _Overlap(llamafactory.model.load_model)
    monkeypatch.setattr(llamafactory.model, "load_model", overlap)  # build_trainer imports it at call time
    trainers, errors = on_threads(lambda i: build_trainer(load_job(job_dict(tiny_llama_path, tmp_path / f"out{i}"))),
                                  2, timeout_s=300)
    assert not errors and None not in trainers, errors
    assert overlap.most == 1
    tables = [t.split.causal_lm.model.rotary_emb.inv_freq for t in trainers]
    assert bool((tables[0] == tables[1]).all())
