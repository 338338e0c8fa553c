"""`loupe serve`: a trained model answering with its zoom loop behind an OpenAI-compatible API, and a page.

main.py builds the server (`loupe serve`), params.py is its `serve` section, requests.py reads and checks what a
client sends, scheduler.py runs every request's turns on the one engine, replies.py shapes the answers, app.py
is the HTTP side, page.html the page at `/`. docs/serve.md is the user's guide.
"""
