"""pollen's privacy parts: the differential-privacy accountant now (:mod:`pollen.privacy.accountant`), the
clipping and noise mechanisms that sit between the decoded updates and the server optimiser later
(``../shared/papers/privacy.md``).

Importing this package needs no privacy library: ``dp-accounting`` (the optional extra ``pollen[dp]``) is
imported when an accountant is built.
"""

from pollen.privacy.accountant import SAMPLINGS, PrivacyAccountant, PrivacySetting

__all__ = ["SAMPLINGS", "PrivacyAccountant", "PrivacySetting"]
