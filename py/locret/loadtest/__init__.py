"""`locret loadtest`: many users chatting with long documents against an OpenAI-compatible server, as an operator
would see them (time to first token, decode speed, latency, right answers, conversations completed per minute,
the server's memory).

- users.py: the user script (who arrives when, with which document and which turns); the same script for every
  server of a side by side;
- drive.py: plays the script against a server with the official `openai` client (asyncio, streaming) and records
  each request;
- figures.py: the run's figures from those records (percentiles, rates, accuracy);
- watch.py: samples the server's RSS and /metrics while the script plays;
- cli.py: the command line.

Why the `openai` client on asyncio and not locust: what is measured is what an application using the official
client sees (streaming, time to the first token of a chat), users are few and long-lived (one conversation each,
turns in order), and the figures need each request's answer to score it; locust's strength (thousands of short
HTTP users, a web UI) is not what this load is, and it would add gevent to the project.
"""
