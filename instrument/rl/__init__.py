"""RL instrumentation: collection, training, counter, timing and evaluation metrics, a progress bar, and the
`RLLogging` set that composes them for a plain loop or a TorchRL trainer (`instrument.rl.torchrl`, imported
only when used). Each part is an `RLComponent`, called only through that interface; attached to an
`Instrumentation`, they are that one session's components (its cadence, its commit, its failure ledger).
Everything goes through the session's `Logger`: values stay on the device until its one batched transfer per
commit.
"""

from instrument.backends.progress import ProgressBar
from instrument.rl.collection import CollectionMetrics
from instrument.rl.component import RLComponent
from instrument.rl.counters import Counters
from instrument.rl.evaluation import Episode, EpisodeRunner, Evaluation
from instrument.rl.rl_logging import RLLogging
from instrument.rl.runner import GymnasiumRunner, select_action
from instrument.rl.timing import StageClock
from instrument.rl.training import TrainMetrics

__all__ = [
    "CollectionMetrics",
    "Counters",
    "Episode",
    "EpisodeRunner",
    "Evaluation",
    "GymnasiumRunner",
    "ProgressBar",
    "RLComponent",
    "RLLogging",
    "StageClock",
    "TrainMetrics",
    "select_action",
]

