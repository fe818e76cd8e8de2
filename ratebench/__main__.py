from ratebench.cli import app

app()
