from compress.cli import _exit

_exit()
