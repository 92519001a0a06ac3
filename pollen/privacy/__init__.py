"""pollen's privacy parts: the differential-privacy accountant now (:mod:`pollen.privacy.accountant`), the
clipping and noise mechanisms that sit between the decoded updates and the server optimiser later
(``../shared/papers/privacy.md``).

Importing this package needs no privacy library: ``dp-accounting`` (the optional extra ``pollen[dp]``) is
imported when an accountant is built. The names below are looked up on first use (PEP 562), not imported
here: a ClientApp imports :mod:`pollen.privacy.mechanisms` while the server may import the accountant in
another thread of the same simulation process, and a package ``__init__`` that imports its own modules then
deadlocks on the import locks (``tests/unit/test_import_order.py``).
"""

from __future__ import annotations

from pollen.core.lazy_exports import lazy_exports

#: Each public name and the module that defines it.
_EXPORTS = {
    "SAMPLINGS": "pollen.privacy.accountant",
    "PrivacyAccountant": "pollen.privacy.accountant",
    "PrivacySetting": "pollen.privacy.accountant",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
