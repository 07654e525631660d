// Stand-in for Apple's <IOSurface/IOSurfaceRef.h> (not on Linux): the handle type in texture calls.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
