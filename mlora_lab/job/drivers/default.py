"""The drivers a job runs with, in order of precedence (a tenant belongs to the first that accepts it).

This list is where a new way of feeding tenants joins the job (see :mod:`mlora_lab.job.drivers.base`): the
training loop itself is not edited.
"""

from __future__ import annotations

from mlora_lab.job.drivers.base import DriverFactory
from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.preference import PreferenceDriver
from mlora_lab.job.drivers.rl import RLDriver

DEFAULT_DRIVERS: tuple[DriverFactory, ...] = (RLDriver, PreferenceDriver, FileData)
