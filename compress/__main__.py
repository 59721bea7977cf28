from compress.cli.main import _exit

_exit()
