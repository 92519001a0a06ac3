"""anchorapp: a minimal Flower App used as the anchor of pollen's deployment benchmark."""
