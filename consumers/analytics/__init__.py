"""Analytics: tools that read the event log for people (tail, export, dashboards, custom consumers).

Empty for now; the event-log tools land here. Topics: any, read-only.
"""
