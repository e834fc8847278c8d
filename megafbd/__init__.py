"""MegaFBD: forward and backward as separate instances with explicit weight sync (see docs/megafbd.md)."""

from megafbd.plugin import MegaFBDPlugin

PLUGIN = MegaFBDPlugin()
