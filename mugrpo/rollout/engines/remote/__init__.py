"""The remote engine (``rollout.engine=remote``): :class:`RemoteEngine` (:mod:`.engine`, the engine
interface), its dispatcher (:mod:`.dispatch`: which service generates what, failover), the HTTP side of
the serving contract (:mod:`.wire`) and the weights files it writes (:mod:`.weights`)."""

from mugrpo.rollout.engines.remote.dispatch import RESUME_HINT
from mugrpo.rollout.engines.remote.engine import RemoteEngine
from mugrpo.rollout.engines.remote.weights import WeightsDirError, default_weights_dir
from mugrpo.rollout.engines.remote.wire import RemoteUnavailable, ServiceRefused

__all__ = ["RESUME_HINT", "RemoteEngine", "RemoteUnavailable", "ServiceRefused", "WeightsDirError",
           "default_weights_dir"]
