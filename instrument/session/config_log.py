"""The run's hyperparameters and operative config: logged once per process, however the run commits.

A training loop logs them at its first ``inst.step`` (or `commit_step`), where the operative gin config is
complete (the model and optimizer were configured by then). A script that commits only through
``inst.logger`` (an evaluation script's ``log_metrics(..., commit=True)``) never gets there, and its
hyperparameters reached no backend; they are logged before the logger closes instead. Not at its first commit:
a training script that commits something before its first step (dataset statistics) would log an operative
config that lacks what is configured after it, and its first step would not log it again.
"""

import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from instrument.logger.ranks import check_same_config

__all__ = ["ConfigLog"]

ConfigSource = Callable[[], Tuple[Dict[str, Any], Optional[str]]]


class ConfigLog:
    """Logs a session's hyperparameters (with the operative config from ``source_of()``, when installed) once.

    It holds the session weakly: a session dropped without close() must still be seen as dropped
    (`instrument.session.dropped`); its logger, kept alive by its writer thread, holds this object."""

    def __init__(self, session: Any, logger: Any, source_of: Callable[[], Optional[ConfigSource]]) -> None:
        self._session = weakref.ref(session)
        self._hyperparams = session.hyperparams  # a session gone at exit: what it was given
        self._logger = logger
        self._source_of = source_of
        self.logged = False
        logger.before_close(self._at_close)

    def log(self, check: bool = True) -> None:
        """Log them now. ``check``: under `torch.distributed`, compare the operative config across ranks (a
        collective: every rank reaches it, at its first step or at close; not at a signal or at exit)."""
        self.logged = True
        session = self._session()
        params = dict(session.hyperparams if session is not None else self._hyperparams)
        text = None
        source = self._source_of()
        if source is not None:  # installed by instrument.config; the session never imports gin
            gin_params, text = source()
            params = {**gin_params, **params}
        if check:  # a no-op without a process group
            check_same_config(text or "", self._logger.reducer.group)
        if params or text:
            self._logger.log_hyperparams(params, text)

    def _at_close(self, prompt: bool) -> None:
        """Before the logger closes, if nothing logged them yet (a run that never entered a step)."""
        if not self.logged:
            self.log(check=not prompt)
