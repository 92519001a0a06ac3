"""Tests of the Flower glue: strategies, client-side mods and steps, the wire (fake grid, no Flower processes)."""
