"""What a run would print that its user cannot act on, filtered at its source (``quiet_lightning``).

* Lightning 2.6's ``CombinedLoader`` builds torch's ``LeafSpec``, which torch 2.13 deprecates: every
  rank would warn once per run about code neither the user nor this package can change.
* Lightning's "💡 Tip:" lines advertise its cloud services (litlogger, litmodels) at every start:
  nothing in them concerns the run being logged.

Nothing else is filtered: every other warning and message still reaches the user.
"""

from __future__ import annotations

import logging
import warnings

#: Lightning's loggers of ``rank_zero_info`` (its fabric and pytorch packages each name one).
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _NoServiceTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


NO_SERVICE_TIPS = _NoServiceTips()


def quiet_lightning() -> None:
    """Install both filters (again: harmless)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    for name in _RANK_ZERO_LOGGERS:
        if NO_SERVICE_TIPS not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(NO_SERVICE_TIPS)
