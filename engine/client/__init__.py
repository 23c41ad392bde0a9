"""API-side engine clients: the thread client (AsyncEngine), the process client and what they share."""
