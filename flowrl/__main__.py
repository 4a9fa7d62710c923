from flowrl.cli import main
from flowrl.utils.launch import finish

finish(main())
