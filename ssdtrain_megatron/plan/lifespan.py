"""SSD lifespan under activation offloading (the SSDTrain paper, Sec. III-D).

rated lifespan = drives x rated TBW / (write_gbps x write_fraction): what the vendor's rating
                 promises, the figure to plan with
endurance      = drives x rated TBW x (waf_rated / waf) x retention_factor
lifespan       = endurance / (write_gbps x write_fraction): the paper's estimate

Drive ratings assume a write-amplification factor of about 2.5 (random small writes); the
offloader's large sequential writes give about 1, so the same flash absorbs 2.5x the host bytes.
Activations live for seconds, so the 3-year data retention the rating assumes can be relaxed
to about a day, which the paper estimates at 86x more program/erase cycles. Neither factor is
a vendor's promise: ``ssdtrain lifespan`` prints the rated lifespan first.

Units are decimal: 1 TB = 1e12 bytes, 1 GB = 1e9 bytes; a year is 365.25 days.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SECONDS_PER_DAY = 86400
DAYS_PER_YEAR = 365.25

WAF_RATED = 2.5
"""Write amplification the TBW rating assumes (JEDEC client/enterprise workloads)."""
WAF = 1.0
"""Write amplification of large sequential activation writes."""
RETENTION_FACTOR = 86.0
"""P/E-cycle gain from relaxing retention from 3 years to 1 day (the paper's estimate)."""


@dataclass(frozen=True)
class Lifespan:
    """How long a set of drives lasts at a given write rate (decimal units)."""

    lifespan_years: float
    """Years (of 365.25 days) until the drives' relaxed endurance is written (the WAF
    correction and the retention factor applied: the paper's estimate)."""

    endurance_bytes: float
    """Bytes the drives absorb: drives x TBW x 1e12 x (waf_rated / waf) x retention_factor."""

    bytes_per_day: float
    """Bytes written per day: write_gbps x 1e9 x write_fraction x 86400."""

    rated_lifespan_years: float = 0.0
    """Years until the drives' rated TBW (drives x TBW, no factor) is written."""

    @property
    def adjustment(self) -> float:
        """lifespan_years / rated_lifespan_years: the WAF correction x the retention factor."""
        return self.lifespan_years / self.rated_lifespan_years if self.rated_lifespan_years else 0.0

    def to_dict(self) -> dict:
        return {"lifespan_years": self.lifespan_years, "endurance_bytes": self.endurance_bytes,
                "bytes_per_day": self.bytes_per_day, "rated_lifespan_years": self.rated_lifespan_years}


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: expected a number > 0")
    return value


def endurance_bytes(drives: int, tbw_per_drive_tb: float, *, waf_rated: float = WAF_RATED,
                    waf: float = WAF, retention_factor: float = RETENTION_FACTOR) -> float:
    """Bytes a set of drives can absorb: drives x rated TBW (1 TB = 1e12 bytes) x WAF
    correction (waf_rated / waf) x retention relaxation."""
    if isinstance(drives, bool) or not isinstance(drives, int) or drives < 1:
        raise ValueError(f"drives={drives!r} is invalid: expected an integer >= 1")
    _positive("tbw_per_drive_tb", tbw_per_drive_tb)
    _positive("waf_rated", waf_rated)
    _positive("waf", waf)
    _positive("retention_factor", retention_factor)
    return drives * (tbw_per_drive_tb * 1e12) * (waf_rated / waf) * retention_factor


def ssd_lifespan(drives: int, tbw_per_drive_tb: float, write_gbps: float, write_fraction: float,
                 *, waf_rated: float = WAF_RATED, waf: float = WAF,
                 retention_factor: float = RETENTION_FACTOR) -> Lifespan:
    """Lifespan of ``drives`` drives rated ``tbw_per_drive_tb`` TB written each, written at
    ``write_gbps`` GB/s (1e9 bytes/s) for ``write_fraction`` of the time.

    Example (the paper's worked example: 4 drives of 600 TBW, 12.1 GB/s for half the step):
        >>> round(ssd_lifespan(4, 600, 12.1, 0.5).lifespan_years, 4)
        2.7027

    Raises:
        ValueError: a non-positive count, rating, bandwidth or factor, or a write_fraction
            outside (0, 1].
    """
    _positive("write_gbps", write_gbps)
    if isinstance(write_fraction, bool) or not isinstance(write_fraction, (int, float)) \
            or not 0 < write_fraction <= 1:
        raise ValueError(f"write_fraction={write_fraction!r} is invalid: expected a number in (0, 1]")
    endurance = endurance_bytes(drives, tbw_per_drive_tb, waf_rated=waf_rated, waf=waf,
                                retention_factor=retention_factor)
    bytes_per_second = write_gbps * 1e9 * write_fraction
    year = bytes_per_second * SECONDS_PER_DAY * DAYS_PER_YEAR
    return Lifespan(lifespan_years=endurance / year, endurance_bytes=endurance,
                    bytes_per_day=bytes_per_second * SECONDS_PER_DAY,
                    rated_lifespan_years=drives * tbw_per_drive_tb * 1e12 / year)
