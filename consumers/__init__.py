"""Consumers: services that act on the event log — ``inference`` (engines that follow weight versions) and
``analytics`` (tools that read topics for people)."""
