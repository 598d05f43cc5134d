"""Reporting: what fxoffload did to each pair, as data (``report``), text (``render``) and a picture
(``plot``)."""
