from kvcore.cli import main

main()
